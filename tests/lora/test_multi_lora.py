"""K LoRA adapters trained at once (``with_lora(..., adapters=K)``) on one packed batch that mixes
the adapters' sequences: each adapter's per-token outputs and gradients equal a single-adapter
LoRA model's run on only that adapter's sequences (same base weights, the adapter's weights
copied in); zero host syncs; per-layer CUDA graphs (Megatron's CudaGraphManager on the CPU
stand-in) replay equal to eager across packings that mix the adapters differently; bad input
refused in one line before device work.

Tolerance: float32; the joint and separate runs attend over different packings (the SDPA mask
of a different T-token batch), so sums run in another order: torch's float32 defaults
(rtol 1.3e-6, atol 1e-5) for outputs, rtol 1e-5 / atol 1e-6 relative to each gradient's size
for gradients (observed ~1e-7)."""

import pytest
import torch

from megatron_fastpath.lora import LoRAConfig, MultiLoRALinear, freeze_base_parameters, with_lora
from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
from megatron_fastpath.sync import SyncSentinel
from tests.support.tiny_gpt import SHAPE, T
from tests.support.tiny_gpt import build_tiny_gpt as build_single

NAMES = ("ada", "bob", "cyd")
K = len(NAMES)
CFG = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets="all-linear")
LENGTHS = [9, 1, 14, 8]
ADAPTERS = [2, 0, 1, 2]  # adapter 2 trains two sequences, the tail (T - 32 = 0 here) none
LENGTHS_TAIL = [5, 6, 3, 7]  # 21 tokens: an 11-token padding tail
ADAPTERS_TAIL = [1, 1, 0, 1]  # adapter 2 absent


def build_joint(shape=SHAPE, seed=0, num_slots=1, **tcfg):
    from megatron_fastpath.layer_spec import get_fastpath_layer_spec

    cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, num_adapters=K,
                                           num_slots=num_slots, rope=rope_config_for(shape)))
    spec = with_lora(get_fastpath_layer_spec(cache, backend="sdpa"), CFG, adapters=NAMES)
    torch.manual_seed(seed)
    model = build_gpt_model(build_transformer_config(shape, **tcfg), spec, shape.vocab_size, T)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # non-zero, different adapters: every one changes the model
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    freeze_base_parameters(model)
    return model, cache


def data(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SHAPE.vocab_size, (1, T), generator=g)
    labels = torch.randint(0, SHAPE.vocab_size, (1, T), generator=g)
    mask = torch.zeros(1, T)
    mask[0, : sum(lengths)] = 1
    return tokens, labels, mask


def run(model, cache, lengths, tokens, labels, mask, adapters=None):
    """Per-token losses [1, T] of one packed batch; backward of their masked sum."""
    kw = {} if adapters is None else {"adapters": adapters}
    with cache.batch(lengths, **kw) as pb:
        out = model(tokens, pb.position_ids_1T, None, labels=labels,
                    packed_seq_params=pb.packed_seq_params)
        (out * mask).sum().backward()
    return out.detach()


def spans(lengths):
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return list(zip(starts, lengths))


def single_for(joint, k):
    """A single-adapter model with the joint model's base weights and adapter ``k``'s."""
    single, cache = build_single(CFG)
    base = {n: v for n, v in joint.state_dict().items() if "lora_" not in n}
    missing, unexpected = single.load_state_dict(base, strict=False)
    assert not unexpected and all("lora_" in n for n in missing)
    joint_mods = dict(joint.named_modules())
    with torch.no_grad():
        for name, mod in single.named_modules():
            if hasattr(mod, "lora_A"):
                mod.lora_A.copy_(joint_mods[name].lora_A[k])
                mod.lora_B.copy_(joint_mods[name].lora_B[k])
    freeze_base_parameters(single)
    return single, cache


def assert_grad_close(got, want, what):
    scale = want.abs().max().clamp_min(1e-12)
    torch.testing.assert_close(got / scale, want / scale, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("lengths, adapters", [(LENGTHS, ADAPTERS), (LENGTHS_TAIL, ADAPTERS_TAIL)],
                         ids=["mixed", "tail_and_absent_adapter"])
def test_joint_equals_separate(mcore_parallel, lengths, adapters):
    joint, cache = build_joint()
    tokens, labels, mask = data(lengths)
    out = run(joint, cache, lengths, tokens, labels, mask, adapters)
    multi = {n: m for n, m in joint.named_modules() if isinstance(m, MultiLoRALinear)}
    assert len(multi) == 4 * SHAPE.num_layers
    for k in range(K):
        mine = [(s, n) for (s, n), a in zip(spans(lengths), adapters) if a == k]
        if not mine:  # an adapter without tokens in the batch: exactly no gradient
            assert all(not m.lora_A.grad[k].any() and not m.lora_B.grad[k].any()
                       for m in multi.values())
            continue
        # the adapter's sequences packed alone, into a single-adapter model
        single, scache = single_for(joint, k)
        own = [n for _, n in mine]
        t1, l1, m1 = torch.zeros_like(tokens), torch.zeros_like(labels), torch.zeros(1, T)
        pos = 0
        for s, n in mine:
            t1[0, pos : pos + n], l1[0, pos : pos + n] = tokens[0, s : s + n], labels[0, s : s + n]
            pos += n
        m1[0, :pos] = 1
        ref = run(single, scache, own, t1, l1, m1)
        pos = 0
        for s, n in mine:
            torch.testing.assert_close(out[0, s : s + n], ref[0, pos : pos + n])
            pos += n
        for name, mod in single.named_modules():
            if hasattr(mod, "lora_A"):
                assert_grad_close(multi[name].lora_A.grad[k], mod.lora_A.grad, f"{name} A[{k}]")
                assert_grad_close(multi[name].lora_B.grad[k], mod.lora_B.grad, f"{name} B[{k}]")


def test_zero_host_syncs_and_ops_independent_of_the_assignment(mcore_parallel):
    joint, cache = build_joint()
    tokens, labels, mask = data(LENGTHS)
    run(joint, cache, LENGTHS, tokens, labels, mask, ADAPTERS)  # warm-up
    ops = []
    for adapters in (ADAPTERS, [0, 0, 0, 0], [1, 2, 0, 1]):
        with cache.batch(LENGTHS, adapters=adapters) as pb:  # host: outside the count
            with SyncSentinel(strict=True, name="multi-adapter LoRA fwd+bwd") as s:
                out = joint(tokens, pb.position_ids_1T, None, labels=labels,
                            packed_seq_params=pb.packed_seq_params)
                (out * mask).sum().backward()
        assert s.num_syncs == 0
        ops.append(s.aten_ops)
    assert ops[0] == ops[1] == ops[2]  # static shapes: the same ops whoever trains what


# ------------------------------------------------------------------------------------------
# per-layer CUDA graphs: Megatron's CudaGraphManager over the CPU stand-in
# ------------------------------------------------------------------------------------------
GRAPH_BATCHES = (([5, 9, 12], [0, 2, 1]), ([5, 9, 12], [1, 1, 0]), ([3, 3, 3, 3, 10, 7], [2, 0, 2, 1, 0, 0]))


def _graph_run(model, cache, steps):
    from tests.support.megatron_graphs import run_steps_releasing

    handles = []

    def forward_step(mb, module):
        (lengths, adapters), (tokens, labels, mask) = mb
        pb = cache.set_batch(lengths, adapters=adapters)  # held until the step's backward
        handles.append(pb)
        out = module(tokens, pb.position_ids_1T, None, labels=labels,
                     packed_seq_params=pb.packed_seq_params)

        def loss_func(per_token):
            loss = (per_token.float() * mask).sum() / 64.0
            return loss, {"loss": loss.detach()}

        return out, loss_func

    return run_steps_releasing(model, cache, handles, steps, forward_step, seq_length=T)


def test_per_layer_graphs_replay_equal_to_eager_across_adapter_mixes(mcore_parallel):
    from megatron_fastpath.graphs import prepare_cuda_graphs
    from megatron_fastpath.lora import lock_lora
    from megatron_fastpath.model import ModelConfig
    from tests.support.megatron_graphs import graph_runners, graph_session

    shape = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=64, vocab_size=SHAPE.vocab_size)
    mbs = [(b, data(b[0], seed=i)) for i, b in enumerate(GRAPH_BATCHES)]
    steps = [[mbs[i] for i in order] for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0])]
    with graph_session():
        prepare_cuda_graphs(1234, use_te_rng_tracker=False)
        eager, ecache = build_joint(shape, num_slots=3)  # a slot per microbatch of a step
        graphed, gcache = build_joint(shape, num_slots=3, cuda_graph_impl="local",
                                      cuda_graph_warmup_steps=0)
        graphed.load_state_dict(eager.state_dict())
        lock_lora(graphed)
        le, ge = _graph_run(eager, ecache, steps)
        lg, gg = _graph_run(graphed, gcache, steps)
        runners = graph_runners(graphed)
        assert len(runners) == 2 and all(r.cudagraph_created for r in runners)
        # step 1 records and captures; steps 2 and 3 replay 3 microbatches each
        assert all(r.fwd_graph.replays == 6 and r.bwd_graph.replays == 6 for r in runners)
    assert any(n.endswith("lora_A") for n in ge[0])
    for s in range(len(steps)):
        torch.testing.assert_close(lg[s], le[s], rtol=1e-5, atol=1e-6)
        for name in ge[s]:
            torch.testing.assert_close(gg[s][name], ge[s][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {s} {name}: {m}")


def test_strict_graph_safety_audit_passes_across_adapter_mixes(mcore_parallel):
    """The CPU graph-safety audit (what the main job runs in place of capture): with one runner
    per layer serving microbatches of different adapter mixes, every per-batch read is a layer
    argument (the params' adapter fields), no host sync, no reallocation."""
    from megatron_fastpath.graphs import GraphSafetyAudit

    joint, cache = build_joint()
    with GraphSafetyAudit(joint, strict=True, one_runner_per_layer=True) as audit:
        for step in range(2):
            with audit.step():
                for i, (lengths, adapters) in enumerate(GRAPH_BATCHES):
                    run(joint, cache, lengths, *data(lengths, seed=3 * step + i), adapters)
    report = audit.report()
    assert report.ok and report.steps == 2
    assert [layer.forward_calls for layer in report.layers] == [6, 6]


@pytest.mark.parametrize("adapters_only", [True, False])
def test_checkpoint_holds_every_adapter(mcore_parallel, tmp_path, adapters_only):
    """The stacked adapters and their optimizer state through a torch_dist checkpoint
    (``sharded_state_dict``: the adapter axis leads, unsharded) into a fresh model."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_fastpath.checkpoint import CheckpointConfig, CheckpointManager, training_parts

    def setup(model):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        sched = OptimizerParamScheduler(
            opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=1, lr_decay_steps=4,
            lr_decay_style="cosine", start_wd=0.0, end_wd=0.0, wd_incr_steps=4,
            wd_incr_style="constant")
        mgr = CheckpointManager(CheckpointConfig(dir=str(tmp_path), adapters_only=adapters_only,
                                                 async_save=False), {"shape": "tiny"},
                                log=lambda s: None)
        return opt, mgr, training_parts(model, opt, sched, adapters_only)

    first, cache = build_joint()
    opt, mgr, parts = setup(first)
    run(first, cache, LENGTHS, *data(LENGTHS), ADAPTERS)
    opt.step()
    mgr.save(1, parts)
    fresh, _ = build_joint()
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            if "lora_" in n:
                p.zero_()
    opt2, mgr2, parts2 = setup(fresh)
    assert mgr2.load(parts2).step == 1
    want = dict(first.named_parameters())
    for n, p in fresh.named_parameters():
        assert torch.equal(p, want[n]), n
    state = {id(p): opt.state[p] for p in opt.param_groups[0]["params"]}
    for p, q in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"]):
        assert torch.equal(opt2.state[q]["exp_avg"], state[id(p)]["exp_avg"])


# ------------------------------------------------------------------------------------------
# refusals
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("adapters, match", [
    (0, "a count K >= 1"), (-2, "a count K >= 1"), ([], "an empty list"),
    (["a", "b", "a"], r"names must be distinct; \['a'\]"), (True, "a count K >= 1"),
])
def test_bad_adapters_refused_at_spec(adapters, match):
    from megatron_fastpath.layer_spec import get_fastpath_layer_spec

    cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, rope=rope_config_for(SHAPE)))
    with pytest.raises(ValueError, match=match):
        with_lora(get_fastpath_layer_spec(cache, backend="sdpa"), CFG, adapters=adapters)


def test_batch_without_adapters_refused_before_the_layer_runs(mcore_parallel):
    joint, _ = build_joint()
    plain = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, rope=rope_config_for(SHAPE)))
    tokens, labels, _ = data(LENGTHS)
    with plain.batch(LENGTHS) as pb, pytest.raises(ValueError, match="needs its batch's adapters"):
        joint(tokens, pb.position_ids_1T, None, labels=labels, packed_seq_params=pb.packed_seq_params)


def test_cache_of_another_adapter_count_refused(mcore_parallel):
    joint, _ = build_joint()
    two = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, num_adapters=2,
                                         rope=rope_config_for(SHAPE)))
    tokens, labels, _ = data(LENGTHS)
    with two.batch(LENGTHS, adapters=[0, 1, 1, 0]) as pb, pytest.raises(
            ValueError, match=r"the batch carries 2 adapters, this layer has 3 \(ada, bob, cyd\)"):
        joint(tokens, pb.position_ids_1T, None, labels=labels, packed_seq_params=pb.packed_seq_params)


def test_graphs_of_parts_of_a_layer_refused(mcore_parallel):
    from megatron_fastpath.graphs import prepare_cuda_graphs
    from tests.support.megatron_graphs import graph_session

    with graph_session(), pytest.raises(
            ValueError, match=r"CUDA graphs of parts of a layer \(\['attn'\]\)"):
        prepare_cuda_graphs(1234, use_te_rng_tracker=False)
        build_joint(cuda_graph_impl="local", cuda_graph_scope=["attn"])


def test_selective_mlp_recompute_refused(mcore_parallel):
    with pytest.raises(ValueError, match="multi-adapter LoRA on linear_fc1 with the selective "
                                         "'mlp' recompute"):
        build_joint(recompute_granularity="selective", recompute_modules=["mlp"])


def test_unaligned_rank_and_merge_refused(mcore_parallel):
    from megatron_fastpath.lora import merge_lora

    with pytest.raises(ValueError, match="the rank 3 must be a multiple of 4 for torch.float32"):
        from megatron_fastpath.layer_spec import get_fastpath_layer_spec

        cache = PackedSeqCache(PackedSeqConfig(max_tokens=T, max_seqs=8, num_adapters=K,
                                               rope=rope_config_for(SHAPE)))
        spec = with_lora(get_fastpath_layer_spec(cache, backend="sdpa"),
                         LoRAConfig(rank=3, dropout=0.0), adapters=K)
        build_gpt_model(build_transformer_config(SHAPE), spec, SHAPE.vocab_size, T)
    joint, _ = build_joint()
    with pytest.raises(ValueError, match="cannot merge 3 adapters into one shared base weight"):
        merge_lora(joint)
    mod = next(m for m in joint.modules() if isinstance(m, MultiLoRALinear))
    want = (mod.lora_B[1] @ mod.lora_A[1]) * mod.scale
    torch.testing.assert_close(mod.merged_weight_delta(adapter=1), want)
    with pytest.raises(ValueError, match=r"needs an adapter index in \[0, 3\)"):
        mod.merged_weight_delta(adapter=3)


# ------------------------------------------------------------------------------------------
# tensor and sequence parallelism: torchrun, 2 gloo ranks
# ------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_tp2_with_and_without_sequence_parallel_equals_single_adapters(tmp_path):
    """tests/workers/multi_lora_tp_worker.py: at TP = 2, the joint model's outputs on each
    adapter's tokens and its gradient slices equal a single-adapter model's on the same packed
    batch (loss of that adapter's tokens); with sequence parallelism (each shard's tokens grouped
    on the device) the same outputs, and the same gradients once Megatron's reduction has summed
    the ``sequence_parallel``-marked ones (A of the column linears, B of the row ones)."""
    import os
    import subprocess
    import sys

    from tests.support.subproc import child_env, free_port

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = str(tmp_path / "tp.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", "-m", "tests.workers.multi_lora_tp_worker", out]
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(OMP_NUM_THREADS="1", PYTHONPATH=repo),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    marked = {f"decoder.layers.{i}.{n}" for i in range(2) for n in (
        "self_attention.linear_qkv.lora_A", "mlp.linear_fc1.lora_A",
        "self_attention.linear_proj.lora_B", "mlp.linear_fc2.lora_B")}
    for r in (0, 1):
        res = torch.load(f"{out}.rank{r}")
        assert torch.equal(res["out_sp"], res["out"])
        assert set(res["sp_marked"]) == marked
        for k in range(2):
            own = res[f"mask_{k}"].bool()
            torch.testing.assert_close(res["out"][own], res[f"out_{k}"][own])
            assert len(res[f"grads_{k}"]) == 16
            for name, want in res[f"grads_{k}"].items():
                assert want.abs().sum() > 0, name
                assert_grad_close(res["grads"][name][k], want, f"rank {r} {name}[{k}]")
                assert_grad_close(res["grads_sp"][name][k], want, f"rank {r} SP {name}[{k}]")
