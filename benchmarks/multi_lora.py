"""K LoRA adapters trained in one joint step against K sequential single-adapter steps.

Both sides in one process, on one frozen base (the same weights) and the same sequences:

* ``joint``: one model of K adapters (``with_lora(spec, cfg, adapters=K)``); the step packs every
  adapter's sequences into ONE packed batch, the adapters' sequences interleaved
  (``cache.batch(lengths, adapters=[...])``), runs forward + backward of the sum of the
  per-adapter losses and one ``torch.optim.AdamW`` step over the stacked adapter parameters;
* ``sequential``: K single-adapter models (``with_lora(spec, cfg)``, the joint model's base
  weights and adapter k's initial weights copied in, one AdamW each); adapter k's step packs
  only its own sequences; the K steps run one after another (K jobs of one step each).

Each adapter's loss is its own tokens' mean cross-entropy (its normalisation), so adapter k's
gradient, update and next loss are the same on both sides up to float32 summation order (the
two packings attend over different batches). The script checks it: ``loss_max_rel_diff`` is
the largest relative difference of a per-adapter loss, over every step run, joint vs sequential
(``loss_rel_diff_per_round``: each round's). The learning rate (1e-3) keeps training stable over
the run's steps: at 1e-2 the small model's loss rises again after three steps and the two
sides' float32 differences grow from 1e-7 to 1e-3 within ten steps (an unstable trajectory
amplifies them), while at 1e-3 the same ten steps stay within 1.1e-7.

Workload: every adapter has sequences of 8..32 tokens (seeded) filling exactly
``--tokens-per-adapter`` tokens; the joint batch is K x that many tokens (its cache's
``max_tokens``), a sequential batch that many. Attention is the ``sdpa`` backend with
``sdpa_layout="auto"`` (the package's CPU default: the padded view when it computes >= 3x fewer
scores than the [T, T] mask; ``sdpa_padded`` in the rows says which each side took),
``max_seqlen`` 32 on both sides.

Columns, per K and model:

* tokens/s: K x tokens-per-adapter over the step's wall time (joint: one step; sequential: the
  sum of the K steps), the MINIMUM time over ``--reps`` rounds after ``--warmup``, the two sides
  alternating within each round (load from other processes hits both alike);
* aten ops / step: ``SyncSentinel``'s count (a ``TorchDispatchMode``: every aten op, the proxy
  for a kernel launch each on a GPU) over forward + backward + optimizer step + zero_grad of
  the second step (AdamW creates its state in the first: 3 ops per parameter), the host's
  packing (``cache.batch``) and the loss weights built before it; sequential: the sum over the
  K steps (``seq_ops_per_adapter`` holds each);
* graph launches: NOT measured (the per-layer graphs on the CPU stand-in are not wired here).
  Without graphs the aten ops are the launch proxy: each is at most one kernel launch (views
  and allocations launch none);
* peak MiB: torch.profiler (``profile_memory=True``) allocator events of one step, summed in
  time order: the highest live bytes above the step's start (activations, gradients, optimizer
  temporaries; the weights and the AdamW state exist before, they are not in it); sequential:
  the largest of its K steps' peaks (they run one after another). ``param_MiB``: the bytes of
  parameters + AdamW state each side holds (the sequential side's K models each hold a base);
* joint / seq: the joint side's figure over the sequential's (tokens/s: > 1 = joint faster).

    nice -n 19 python benchmarks/multi_lora.py --reps 8 --json benchmarks/results/multi_lora.json
    python benchmarks/multi_lora.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # load_meter, text_table

from load_meter import LoadMeter, describe, publish  # noqa: E402
from text_table import text_table  # noqa: E402

MODELS = {  # name -> (layers, hidden, heads, query groups, ffn)
    "tiny": (2, 64, 4, 2, 128),
    "small": (4, 256, 8, 4, 512),
}
VOCAB = 256
MAX_SEQLEN = 32
RANK, ALPHA, LR = 8, 16.0, 1e-3


def shape_of(name: str):
    from megatron_fastpath.model import ModelConfig

    L, H, heads, groups, F_ = MODELS[name]
    return ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=heads,
                       num_query_groups=groups, ffn_hidden_size=F_, vocab_size=VOCAB)


def lora_config():
    from megatron_fastpath.lora import LoRAConfig

    return LoRAConfig(rank=RANK, alpha=ALPHA, dropout=0.0, targets="all-linear")


# -- data ---------------------------------------------------------------------------------
def adapter_sequences(K: int, tokens_per_adapter: int, seed: int = 0) -> list:
    """Per adapter: a list of (tokens [n], labels [n]) whose lengths (8..32) sum to exactly
    ``tokens_per_adapter``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(K):
        seqs, left = [], tokens_per_adapter
        while left:
            # the last sequence takes the rest; none leaves fewer than 8 tokens behind
            n = left if left <= MAX_SEQLEN else int(
                torch.randint(8, min(MAX_SEQLEN, left - 8) + 1, (1,), generator=g))
            seqs.append((torch.randint(0, VOCAB, (n,), generator=g),
                         torch.randint(0, VOCAB, (n,), generator=g)))
            left -= n
        out.append(seqs)
    return out


def interleave(per_adapter: list) -> list:
    """[(adapter, tokens, labels)] taking one sequence of each adapter in turn."""
    order, i = [], 0
    while any(i < len(s) for s in per_adapter):
        order += [(k, *s[i]) for k, s in enumerate(per_adapter) if i < len(s)]
        i += 1
    return order


def packed(seqs: list, T: int, K: int):
    """(lengths, adapters, tokens [1, T], labels [1, T], weights [K, T]) of one packed batch:
    ``weights[k, t]`` is 1 / (adapter k's tokens) on adapter k's tokens, 0 elsewhere (the
    padding tail included), so ``(weights * per_token).sum(1)`` is each adapter's mean loss."""
    tokens, labels = torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T, dtype=torch.long)
    weights = torch.zeros(K, T)
    lengths, adapters, pos = [], [], 0
    for k, t, l in seqs:
        n = len(t)
        tokens[0, pos : pos + n], labels[0, pos : pos + n] = t, l
        weights[k, pos : pos + n] = 1.0
        lengths.append(n)
        adapters.append(k)
        pos += n
    weights /= weights.sum(1, keepdim=True).clamp_min(1.0)
    return lengths, adapters, tokens, labels, weights


# -- models -------------------------------------------------------------------------------
def _cache(shape, T, max_seqs, K=None):
    from megatron_fastpath.model import rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
    from megatron_fastpath.packed_seq.config import seqlen_bound

    return PackedSeqCache(PackedSeqConfig(
        max_tokens=T, max_seqs=max_seqs, max_seqlen=seqlen_bound(MAX_SEQLEN, T),
        num_adapters=K, rope=rope_config_for(shape)))


def _model(shape, cache, adapters=None, seed=0):
    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.lora import with_lora
    from megatron_fastpath.model import build_gpt_model, build_transformer_config

    spec = with_lora(get_fastpath_layer_spec(cache, backend="sdpa"), lora_config(),
                     adapters=adapters)
    torch.manual_seed(seed)
    return build_gpt_model(build_transformer_config(shape), spec, VOCAB, cache.config.max_tokens)


def build_sides(shape, K: int, per_adapter: list, tokens_per_adapter: int):
    """(joint, [single] * K): each ``dict(model, cache, opt)``; the singles carry the joint
    model's base weights and adapter k's weights (its A's initialisation differs per adapter)."""
    from megatron_fastpath.lora import freeze_base_parameters

    jcache = _cache(shape, K * tokens_per_adapter, sum(len(s) for s in per_adapter), K)
    joint = _model(shape, jcache, adapters=K)
    freeze_base_parameters(joint)
    base = {n: v for n, v in joint.state_dict().items() if "lora_" not in n}
    jmods = dict(joint.named_modules())
    singles = []
    for k in range(K):
        cache = _cache(shape, tokens_per_adapter, len(per_adapter[k]))
        model = _model(shape, cache)
        missing, unexpected = model.load_state_dict(base, strict=False)
        assert not unexpected and all("lora_" in n for n in missing), (missing, unexpected)
        with torch.no_grad():
            for name, mod in model.named_modules():
                if hasattr(mod, "lora_A"):
                    mod.lora_A.copy_(jmods[name].lora_A[k])
                    mod.lora_B.copy_(jmods[name].lora_B[k])
        freeze_base_parameters(model)
        singles.append(dict(model=model, cache=cache))
    sides = [dict(model=joint, cache=jcache)] + singles
    for s in sides:
        s["opt"] = torch.optim.AdamW([p for p in s["model"].parameters() if p.requires_grad], lr=LR)
    return sides[0], sides[1:]


def held_bytes(side) -> int:
    """Parameters + the optimizer's state tensors."""
    n = sum(p.numel() * p.element_size() for p in side["model"].parameters())
    for st in side["opt"].state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


# -- one step -----------------------------------------------------------------------------
def step(side, batch, count=False):
    """One training step on ``batch`` (``packed``'s tuple); (per-adapter losses, aten ops)."""
    from megatron_fastpath.sync import SyncSentinel

    lengths, adapters, tokens, labels, weights = batch
    model, cache, opt = side["model"], side["cache"], side["opt"]
    kw = {"adapters": adapters} if cache.config.num_adapters is not None else {}
    with cache.batch(lengths, **kw) as pb:  # the host's packing: outside the count
        with SyncSentinel(name="multi-lora step") if count else contextlib.nullcontext() as s:
            per_token = model(tokens, pb.position_ids_1T, None, labels=labels,
                              packed_seq_params=pb.packed_seq_params)
            losses = (per_token.float() * weights).sum(1)
            losses.sum().backward()
            opt.step()
            opt.zero_grad()
    return losses.detach(), (s.aten_ops if count else None)


def profiled_peak(fn) -> int:
    """Peak live bytes above the start over ``fn()``: torch.profiler's allocator events in time
    order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def measure(model_name: str, K: int, tokens_per_adapter: int, reps: int = 8,
            warmup: int = 0) -> dict:
    shape = shape_of(model_name)
    per_adapter = adapter_sequences(K, tokens_per_adapter)
    joint, singles = build_sides(shape, K, per_adapter, tokens_per_adapter)
    T = K * tokens_per_adapter
    jbatch = packed(interleave(per_adapter), T, K)
    sbatches = [packed([(0, *s) for s in seqs], tokens_per_adapter, 1) for seqs in per_adapter]
    # the same sequences, the adapters' order reversed and contiguous: another mix, same ops
    jbatch_other = packed([(k, *s) for k in reversed(range(K)) for s in per_adapter[k]], T, K)

    diffs, jt, st = [], [], []

    def compare(jl, sl):
        ref = torch.cat(sl)
        diffs.append(float(((jl - ref).abs() / ref.abs()).max()))

    # round 0 creates AdamW's state (3 ops per parameter, first step only); round 1 is
    # counted, round 2 counts the joint step on the other mix, round 3 is profiled; every step
    # trains both sides alike, so their losses are compared after every round
    jl, _ = step(joint, jbatch)
    compare(jl, [step(s, b)[0] for s, b in zip(singles, sbatches)])
    jl, jops = step(joint, jbatch, count=True)
    counted = [step(s, b, count=True) for s, b in zip(singles, sbatches)]
    compare(jl, [l for l, _ in counted])
    seq_ops = [ops for _, ops in counted]
    jl, jops_other = step(joint, jbatch_other, count=True)
    compare(jl, [step(s, b)[0] for s, b in zip(singles, sbatches)])
    out = {}
    jpeak = profiled_peak(lambda: out.__setitem__("j", step(joint, jbatch)[0]))
    speaks = [profiled_peak(lambda s=s, b=b, k=k: out.__setitem__(k, step(s, b)[0]))
              for k, (s, b) in enumerate(zip(singles, sbatches))]
    compare(out["j"], [out[k] for k in range(K)])
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        jl, _ = step(joint, jbatch)
        t1 = time.perf_counter()
        sl = [step(s, b)[0] for s, b in zip(singles, sbatches)]
        t2 = time.perf_counter()
        compare(jl, sl)
        if i >= warmup:
            jt.append(t1 - t0)
            st.append(t2 - t1)
    jms, sms = min(jt) * 1e3, min(st) * 1e3
    return dict(
        model=model_name, layers=shape.num_layers, hidden=shape.hidden_size, adapters=K,
        rank=RANK, tokens_per_adapter=tokens_per_adapter, tokens_per_step=T,
        sequences=sum(len(s) for s in per_adapter),
        sdpa_padded=dict(joint=joint["cache"].config.sdpa_padded,
                         sequential=singles[0]["cache"].config.sdpa_padded),
        joint_ms=jms, seq_ms=sms, joint_ms_median=statistics.median(jt) * 1e3,
        seq_ms_median=statistics.median(st) * 1e3, repeats=len(jt),
        joint_tokens_per_s=T / jms * 1e3, seq_tokens_per_s=T / sms * 1e3,
        tokens_per_s_ratio=sms / jms,
        joint_aten_ops=jops, joint_aten_ops_other_mix=jops_other, seq_aten_ops=sum(seq_ops),
        seq_ops_per_adapter=seq_ops, aten_ops_ratio=jops / sum(seq_ops),
        graph_launches="not measured",
        joint_peak_bytes=jpeak, seq_peak_bytes=max(speaks), seq_peak_bytes_per_adapter=speaks,
        peak_ratio=jpeak / max(speaks),
        joint_held_bytes=held_bytes(joint), seq_held_bytes=sum(held_bytes(s) for s in singles),
        loss_max_rel_diff=max(diffs), loss_checks=len(diffs) * K,
        loss_rel_diff_per_round=diffs,
    )


def _mib(n) -> str:
    return f"{n / 2**20:.2f}"


def format_table(rows) -> str:
    cols = ["model", "K", "tokens", "tokens/s joint", "tokens/s seq", "joint/seq tok/s",
            "aten ops joint", "aten ops seq", "joint/seq ops", "peak MiB joint", "peak MiB seq",
            "joint/seq peak", "param MiB joint", "param MiB seq", "max rel d loss"]
    cells = [[r["model"], str(r["adapters"]), str(r["tokens_per_step"]),
              f"{r['joint_tokens_per_s']:.0f}", f"{r['seq_tokens_per_s']:.0f}",
              f"{r['tokens_per_s_ratio']:.2f}", str(r["joint_aten_ops"]), str(r["seq_aten_ops"]),
              f"{r['aten_ops_ratio']:.3f}", _mib(r["joint_peak_bytes"]), _mib(r["seq_peak_bytes"]),
              f"{r['peak_ratio']:.2f}", _mib(r["joint_held_bytes"]), _mib(r["seq_held_bytes"]),
              f"{r['loss_max_rel_diff']:.1e}"] for r in rows]
    return text_table(cols, cells)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--tokens-per-adapter", type=int, default=64)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed rounds (the counted and the profiled rounds run first anyway)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, K 1 and 3, 32 tokens per adapter, 1 rep")
    p.add_argument("--json", type=Path, default=None, help="write results here (and .txt beside)")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.adapters, args.tokens_per_adapter = ["tiny"], [1, 3], 32
        args.reps, args.warmup = 1, 0
    if args.tokens_per_adapter < 8:
        p.error(f"--tokens-per-adapter {args.tokens_per_adapter}: at least 8 (one sequence)")
    if min(args.adapters) < 1:
        p.error(f"--adapters {min(args.adapters)}: at least 1 adapter")

    from megatron_fastpath.distributed import init_distributed

    rows = []
    with LoadMeter() as meter:
        init_distributed(backend="gloo")  # a 1-process group: Megatron's modules read parallel state
        for name in args.models:
            for K in args.adapters:
                r = measure(name, K, args.tokens_per_adapter, args.reps, args.warmup)
                rows.append(r)
                print(f"  {name} K={K} tok/s joint {r['joint_tokens_per_s']:.0f} seq "
                      f"{r['seq_tokens_per_s']:.0f} ops {r['joint_aten_ops']}/{r['seq_aten_ops']} "
                      f"dloss {r['loss_max_rel_diff']:.1e}", flush=True)
    env = dict(torch=torch.__version__, torch_threads=torch.get_num_threads(),
               models={n: dict(zip(("layers", "hidden", "heads", "query_groups", "ffn"), v),
                               vocab=VOCAB) for n, v in MODELS.items()},
               lora=dict(rank=RANK, alpha=ALPHA, targets="all-linear", optimizer="AdamW",
                         lr=LR), **meter.report())
    text = "\n".join([
        format_table(rows), "",
        "joint: one K-adapter model, one packed batch of all K adapters' sequences, one AdamW "
        "step; seq: K single-adapter models (same base), one step each on its own sequences",
        "tokens/s: min step time over repeats (seq: the K steps' sum); aten ops: fwd+bwd+AdamW "
        "step per step (seq: sum over K); graph launches not measured (eager: one per aten op)",
        "peak: torch.profiler allocator events, highest live bytes above a step's start (seq: "
        "the largest of its K steps); param: parameters + AdamW state held",
        describe(env)])
    return publish(args, env, rows, text)


if __name__ == "__main__":
    main()
