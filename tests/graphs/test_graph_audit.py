"""The CPU graph-safety audit passes (strict) on our spec and fails, naming the place, on an
injected host sync, a Python branch on a value, a buffer reallocated between steps and a
layer argument CudaGraphManager would not match."""

import dataclasses

import pytest
import torch

from megatron_fastpath.graphs import GraphSafetyAudit, GraphSafetyError
from megatron_fastpath.lora import LoRAConfig, freeze_base_parameters, lora_modules
from tests.support.tiny_gpt import LENGTHS, batch
from tests.support.tiny_gpt import build_tiny_gpt as build


def train_steps(model, cache, audit, steps=3, before_step=None, params_hook=None):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    for step in range(steps):
        if before_step:
            before_step(step)
        with audit.step():
            tokens, labels, mask = batch(step)
            with cache.batch(LENGTHS) as pb:
                params = params_hook(step, pb.packed_seq_params) if params_hook else pb.packed_seq_params
                out = model(tokens, pb.position_ids_1T, None, labels=labels, packed_seq_params=params)
                (out * mask).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def lora_model(mcore_parallel):
    model, cache = build(LoRAConfig(rank=4, dropout=0.1))
    freeze_base_parameters(model)
    return model, cache


def test_strict_audit_passes_on_dense_packed_lora(lora_model):
    model, cache = lora_model
    with GraphSafetyAudit(model, strict=True) as audit:
        train_steps(model, cache, audit, steps=3)
    report = audit.report()
    assert report.ok and report.steps == 3
    assert [l.forward_calls for l in report.layers] == [3, 3]
    assert all(l.external_reads > 0 for l in report.layers)  # weights, adapters, cache buffers
    assert "PASS" in report.summary()


def inject(module, fn):
    """Run fn(output) after module's forward (an instance-level patch, test only)."""
    original = module.forward

    def patched(*a, **k):
        out = original(*a, **k)
        fn(out)
        return out

    module.forward = patched


def test_injected_item_fails_naming_layer_and_line(lora_model):
    model, cache = lora_model
    layer2 = model.decoder.layers[1]
    inject(layer2.mlp, lambda out: out[0].sum().item())
    with GraphSafetyAudit(model, strict=True) as audit:
        with pytest.raises(GraphSafetyError, match=r"layer 2 forward .*\[sync\] host sync host_read:item at .*test_graph_audit.py"):
            train_steps(model, cache, audit, steps=1)
    # the failed strict step left no dispatch mode behind
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert _get_current_dispatch_mode_stack() == []
    with GraphSafetyAudit(model) as audit:
        train_steps(model, cache, audit, steps=2)
    rep = audit.report()
    assert not rep.ok
    assert [l.syncs_forward for l in rep.layers] == [0, 2]  # one per step, in layer 2 only


def test_value_branch_reported_as_branch(lora_model):
    model, cache = lora_model

    def branch(out):
        if out[0].sum() > 0:  # data-dependent Python control flow
            pass

    inject(model.decoder.layers[0].self_attention, branch)
    with GraphSafetyAudit(model) as audit:
        train_steps(model, cache, audit, steps=1)
    rep = audit.report()
    assert rep.layers[0].value_branches == 1 and rep.layers[1].ok
    assert rep.findings[0].check == "branch" and "test_graph_audit.py" in rep.findings[0].location


def test_sync_in_backward_is_attributed_to_the_layer(lora_model):
    model, cache = lora_model

    class SyncInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            g.abs().max().item()
            return g

    mlp = model.decoder.layers[1].mlp
    original = mlp.forward
    mlp.forward = lambda *a, **k: (lambda o: (SyncInBackward.apply(o[0]), o[1]))(original(*a, **k))
    with GraphSafetyAudit(model) as audit:
        train_steps(model, cache, audit, steps=1)
    rep = audit.report()
    assert [(l.syncs_forward, l.syncs_backward) for l in rep.layers] == [(0, 0), (0, 1)]
    assert rep.findings[0].phase == "backward"


def test_buffer_reallocated_between_steps_is_found(lora_model):
    model, cache = lora_model
    norms = [layer.input_layernorm for layer in model.decoder.layers]

    def realloc(step):
        if step == 2:
            for norm in norms:  # a tensor the layer reads that is not one of its arguments
                norm.weight.data = norm.weight.data.clone()  # new address

    with GraphSafetyAudit(model) as audit:  # step 1 warmup, step 2 reference
        train_steps(model, cache, audit, steps=4, before_step=realloc)
    rep = audit.report()
    # a graph captured at step 2 would replay the old address: steps 3 and 4 both differ
    assert [l.moved_buffers for l in rep.layers] == [2, 2]
    assert all(f.check == "buffer" for f in rep.findings)
    assert sorted({f.step for f in rep.findings}) == [3, 4]


def test_moved_packed_seq_params_fields_are_graph_inputs_not_findings(lora_model):
    """The cache's per-batch tensors ride in packed_seq_params: CudaGraphManager copies every
    tensor field of a dataclass kwarg into its input buffers at replay, so new addresses there
    are fine (what one runner serving several microbatches from different slots relies on)."""
    model, cache = lora_model

    def fresh(step, params):
        return dataclasses.replace(params, **{k: v.clone() for k, v in params.tensors().items()})

    with GraphSafetyAudit(model, strict=True) as audit:
        train_steps(model, cache, audit, steps=4, params_hook=fresh)
    assert audit.report().ok


def test_reallocated_lora_parameter_fails_strict(lora_model):
    model, cache = lora_model
    adapter = next(lora_modules(model))

    def realloc(step):
        if step == 2:
            adapter.lora_A.data = adapter.lora_A.data.clone()

    with GraphSafetyAudit(model, strict=True) as audit:
        with pytest.raises(GraphSafetyError, match=r"layer 1 forward \(step 3\) \[buffer\].*reallocated"):
            train_steps(model, cache, audit, steps=3, before_step=realloc)


def test_changing_non_tensor_argument_is_a_cudagraph_mismatch(lora_model):
    model, cache = lora_model

    def vary(step, params):
        return dataclasses.replace(params, max_seqlen_q=16) if step == 1 else params

    with GraphSafetyAudit(model) as audit:
        train_steps(model, cache, audit, steps=2, params_hook=vary)
    rep = audit.report()
    assert [l.arg_mismatches for l in rep.layers] == [1, 1]
    assert "Value mismatch at kwargs['packed_seq_params'].max_seqlen_q" in str(rep.findings[0])


def train_microbatches(model, cache, audit, steps, per_step, before_mb):
    """per_step microbatches per step (one CUDA-graph runner per layer serves them all)."""
    for step in range(steps):
        with audit.step():
            for k in range(per_step):
                before_mb(k)
                tokens, labels, mask = batch(step * per_step + k)
                with cache.batch(LENGTHS) as pb:
                    out = model(tokens, pb.position_ids_1T, None, labels=labels,
                                packed_seq_params=pb.packed_seq_params)
                    (out * mask).sum().backward()


def test_buffer_chosen_in_python_per_microbatch_is_a_runner_finding(lora_model):
    """What the stand-in shows replaying Megatron's CudaGraphManager: a side read chosen in
    Python per microbatch replays the captured microbatch's buffer."""
    model, cache = lora_model
    tables = [torch.ones(8), torch.full((8,), 2.0)]
    which = [0]
    inject(model.decoder.layers[1].mlp, lambda out: out[0][..., :8] * tables[which[0]])

    def before_mb(k):
        which[0] = k % 2

    with GraphSafetyAudit(model, one_runner_per_layer=True) as audit:
        train_microbatches(model, cache, audit, steps=2, per_step=3, before_mb=before_mb)
    rep = audit.report()
    assert [l.per_microbatch_reads for l in rep.layers] == [0, 2]  # microbatch 2 of each step
    assert [f.check for f in rep.findings] == ["runner", "runner"]
    assert "call 2 of step 1 vs call 1 of step 1" in rep.findings[0].message
    assert "(8,)" in rep.findings[0].message and not rep.ok


def test_per_microbatch_data_read_outside_the_arguments_is_a_content_finding(lora_model):
    model, cache = lora_model
    side = torch.zeros(8)
    inject(model.decoder.layers[0].self_attention, lambda out: out[0][..., :8] + side)

    def before_mb(k):
        side.fill_(float(k))  # same address, new per-microbatch content, written in Python

    with GraphSafetyAudit(model, strict=True, one_runner_per_layer=True) as audit:
        with pytest.raises(GraphSafetyError, match=r"layer 1 forward \(step 1\) \[content\].*"
                                                   r"must be a graph input"):
            train_microbatches(model, cache, audit, steps=1, per_step=3, before_mb=before_mb)
    with GraphSafetyAudit(model, one_runner_per_layer=True) as audit:
        train_microbatches(model, cache, audit, steps=2, per_step=3, before_mb=before_mb)
    assert [l.per_microbatch_reads for l in audit.report().layers] == [4, 0]


def test_constant_side_reads_and_parameter_updates_are_not_findings(lora_model):
    """Weights change between steps (optimizer) and a constant side table is read by every
    microbatch: a replayed runner handles both."""
    model, cache = lora_model
    table = torch.arange(8.0)
    inject(model.decoder.layers[1].mlp, lambda out: out[0][..., :8] * table)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    with GraphSafetyAudit(model, strict=True, one_runner_per_layer=True) as audit:
        for step in range(2):
            train_microbatches(model, cache, audit, steps=1, per_step=3, before_mb=lambda k: None)
            opt.step()
            opt.zero_grad()
    assert audit.report().ok and audit.steps == 2
