"""LoRA adapters inside the fastpath layer spec: exact no-op at init, only adapters train,
merging preserves outputs, parameter counts match r*(in+out), and locked adapters refuse
toggling (what CUDA-graph capture requires)."""

import pytest
import torch

from megatron_fastpath.lora import (
    AdaptersLockedError,
    LoRAConfig,
    LoRALinear,
    freeze_base_parameters,
    lock_lora,
    lora_modules,
    lora_parameter_count,
    merge_lora,
    set_lora_enabled,
)
from megatron_fastpath.model import ModelConfig, build_transformer_config
from tests.support.tiny_gpt import LENGTHS, SHAPE, batch
from tests.support.tiny_gpt import build_tiny_gpt as build

def loss_of(model, cache, seed=0):
    tokens, labels, mask = batch(seed)
    with cache.batch(LENGTHS) as pb:
        out = model(tokens, pb.position_ids_1T, None, labels=labels,
                    packed_seq_params=pb.packed_seq_params)
    return (out * mask).sum() / mask.sum(), out


def base_state(model):
    """State dict of the LoRA model in the plain model's names (drop adapters, unwrap base)."""
    return {k.replace(".base.", "."): v for k, v in model.state_dict().items()
            if "lora_" not in k}


def test_outputs_equal_base_model_at_init(mcore_parallel):
    lora_model, c1 = build(LoRAConfig(rank=4, alpha=8, dropout=0.0))
    plain, c2 = build()
    plain.load_state_dict(base_state(lora_model), strict=False)
    _, a = loss_of(lora_model, c1)
    _, b = loss_of(plain, c2)
    assert torch.equal(a, b)  # B = 0: exactly the base model
    assert sum(1 for _ in lora_modules(lora_model)) == 2 * SHAPE.num_layers


def test_only_adapters_change_and_merge_preserves_outputs(mcore_parallel):
    model, cache = build(LoRAConfig(rank=4, alpha=8, dropout=0.1))
    trainable = freeze_base_parameters(model)
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)
    for step in range(5):
        loss, _ = loss_of(model, cache, seed=step)
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(after[k], before[k])}
    assert changed and all(k.endswith(("lora_A", "lora_B")) for k in changed), changed
    assert trainable == lora_parameter_count(2, 64, 4, 2, rank=4)

    model.eval()
    with torch.no_grad():
        _, with_adapters = loss_of(model, cache)
        merge_lora(model)
        _, merged = loss_of(model, cache)
    assert not all(m.enabled for m in lora_modules(model))
    torch.testing.assert_close(merged, with_adapters, rtol=1e-5, atol=1e-5)


def test_parameter_count_matches_formula_for_all_targets(mcore_parallel):
    cfg = LoRAConfig(rank=8, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    model, _ = build(cfg)
    counted = sum(m.lora_A.numel() + m.lora_B.numel() for m in lora_modules(model))
    assert counted == lora_parameter_count(2, 64, 4, 2, rank=8, targets=cfg.targets,
                                           ffn_hidden_size=96)
    for m in lora_modules(model):  # r * (in + out) per adapted linear
        out_f, in_f = m.base.weight.shape
        assert m.lora_A.numel() + m.lora_B.numel() == 8 * (in_f + out_f)


def test_llama2_70b_lora_count_reconciled_with_mlperf(mcore_parallel, capsys):
    """MLPerf's Llama-2-70B LoRA (r=16 on QKV and output projection) quotes '~55M (0.08%)'."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    cfg70 = build_transformer_config(ModelConfig(num_layers=80, hidden_size=8192,
                                                 num_attention_heads=64, num_query_groups=8,
                                                 ffn_hidden_size=28672, vocab_size=32000))
    lora = LoRAConfig(rank=16, alpha=32, dropout=0.1)
    with torch.device("meta"):  # real Megatron linears of the 70B shape, no memory
        kw = dict(config=cfg70, init_method=cfg70.init_method, bias=False, skip_bias_add=True,
                  is_expert=False)
        qkv = LoRALinear(8192, 10240, gather_output=False, base=ColumnParallelLinear, lora=lora,
                         parallel="column", **kw)
        proj = LoRALinear(8192, 8192, input_is_parallel=True, base=RowParallelLinear, lora=lora,
                          parallel="row", **kw)
    per_layer = sum(p.numel() for m in (qkv, proj) for p in (m.lora_A, m.lora_B))
    fused = 80 * per_layer
    assert fused == lora_parameter_count(80, 8192, 64, 8, rank=16) == 44_564_480
    # HF PEFT (the MLPerf reference) adapts q, k, v, o separately: A and B per projection.
    per_projection = 80 * 16 * ((8192 + 8192) + 2 * (8192 + 1024) + (8192 + 8192))
    assert per_projection == 65_536_000
    base = 68_976_648_192  # Llama-2-70B parameters
    print(f"Llama-2-70B LoRA r=16: fused QKV+proj {fused:,} ({fused / base:.3%}); "
          f"per-projection q,k,v,o {per_projection:,} ({per_projection / base:.3%}); "
          f"MLPerf quotes ~55M (0.08%), between the two")
    assert fused / base < 0.0008 < per_projection / base


def test_toggle_and_merge_refused_after_lock(mcore_parallel):
    model, _ = build(LoRAConfig(rank=2, dropout=0.0))
    set_lora_enabled(model, False)
    set_lora_enabled(model, True)
    lock_lora(model)
    set_lora_enabled(model, True)  # no change: allowed
    with pytest.raises(AdaptersLockedError, match="after CUDA-graph capture"):
        set_lora_enabled(model, False)
    with pytest.raises(AdaptersLockedError):
        merge_lora(model)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0), "positive int"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (dict(targets=("linear_q",)), "unknown LoRA target"),
        (dict(dtype="int8"), "LoRA dtype"),
    ],
)
def test_bad_lora_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**kwargs)


def test_freeze_without_adapters_is_an_error(mcore_parallel):
    model, _ = build()
    with pytest.raises(ValueError, match="no LoRA parameters"):
        freeze_base_parameters(model)


@pytest.mark.gpu
def test_lora_dropout_uses_megatron_rng_tracker_and_stays_bf16_under_fp8(mcore_parallel):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel import RowParallelLinear

    model_parallel_cuda_manual_seed(123)
    cfg = build_transformer_config(SHAPE, params_dtype=torch.bfloat16)
    cfg.use_cpu_initialization = False
    # a row-parallel base: its input is sharded over TP, so the mask is the tracker's
    m = LoRALinear(64, 64, config=cfg, init_method=cfg.init_method, bias=False, input_is_parallel=True,
                   skip_bias_add=True, is_expert=False, base=RowParallelLinear,
                   lora=LoRAConfig(rank=4, dropout=0.5), parallel="row").cuda()
    torch.nn.init.normal_(m.lora_B)
    x = torch.randn(8, 1, 64, device="cuda", dtype=torch.bfloat16)
    state = get_cuda_rng_tracker().get_states()
    a = m.adapter(x)
    get_cuda_rng_tracker().set_states(state)
    b = m.adapter(x)
    assert torch.equal(a, b)  # the dropout mask came from the tracker's state
    assert m.lora_A.dtype == torch.bfloat16 and a.dtype == torch.bfloat16


# --------------------------------------------------------------------------- TE fused LayerNorm
class _TELayerNormLinearStandIn(torch.nn.Module):
    """Megatron 0.16.1's TELayerNormColumnParallelLinear over TE's LayerNormLinear, by their
    real contracts: TE reads ``return_layernorm_output`` at forward and returns ``(out, ln_out)``
    (``(out, bias, ln_out)`` with ``return_bias``); Megatron's wrapper returns TE's tuple as is
    when ``te_return_bias``, else ``(te_out, None)``. TE is not installed here."""

    def __init__(self, input_size, output_size, *, te_return_bias=False, tp_group=None):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.weight = torch.nn.Parameter(torch.randn(output_size, input_size, generator=g) * 0.1)
        self.bias = torch.nn.Parameter(torch.randn(output_size, generator=g)) if te_return_bias else None
        self.layer_norm_weight = torch.nn.Parameter(1 + torch.randn(input_size, generator=g) * 0.1)
        self.return_layernorm_output = False  # as Megatron constructs it
        self.te_return_bias = te_return_bias
        self.tp_group = tp_group

    def forward(self, x):
        ln_out = torch.nn.functional.rms_norm(x, x.shape[-1:], self.layer_norm_weight)
        out = torch.nn.functional.linear(ln_out, self.weight)
        if self.te_return_bias:
            te = (out, self.bias, ln_out) if self.return_layernorm_output else (out, self.bias)
            return te
        te = (out, ln_out) if self.return_layernorm_output else out
        return te, None


@pytest.mark.parametrize("te_return_bias", [False, True], ids=["no_bias", "te_return_bias"])
def test_lora_on_te_layernorm_linear_sees_the_normalised_input(mcore_parallel, te_return_bias):
    """Today's adapter unpacked ``((out, ln_out), None)`` as ``(output, bias), ln_out``: bias got
    the normalised input and the adapter got None."""
    lora = LoRAConfig(rank=4, alpha=8.0, dropout=0.0)
    layer = LoRALinear(16, 24, te_return_bias=te_return_bias, base=_TELayerNormLinearStandIn,
                       lora=lora, parallel="column")
    assert layer.base.return_layernorm_output is True
    torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(5, 2, 16)
    output, bias = layer(x)
    ln_out = torch.nn.functional.rms_norm(x, (16,), layer.base.layer_norm_weight)
    expected = ln_out @ layer.base.weight.T + 2.0 * (ln_out @ layer.lora_A.T) @ layer.lora_B.T
    torch.testing.assert_close(output, expected)
    assert (bias is layer.base.bias) if te_return_bias else bias is None


def test_layernorm_output_shim_keeps_te_ln_out_ungathered(mcore_parallel):
    """Sequence parallelism: the adapter expects this rank's shard of the normalised input (TE's
    default); a linear set to return it gathered is set back."""
    from megatron_fastpath.compat import te as te_compat

    linear = _TELayerNormLinearStandIn(4, 4)
    linear.return_layernorm_output_gathered = True
    te_compat.return_layernorm_output(linear)
    assert linear.return_layernorm_output is True and linear.return_layernorm_output_gathered is False


def test_layernorm_output_shims_refuse_an_unchecked_megatron(monkeypatch):
    from packaging.version import Version

    from megatron_fastpath import compat
    from megatron_fastpath.compat import te as te_compat

    assert te_compat.split_layernorm_linear_output(((1, 2), None)) == (1, None, 2)
    assert te_compat.split_layernorm_linear_output((1, 3, 2)) == (1, 3, 2)
    with pytest.raises(TypeError, match="not a Transformer Engine LayerNormLinear"):
        te_compat.return_layernorm_output(torch.nn.Linear(2, 2))
    monkeypatch.setattr(compat, "MCORE_VERSION", Version("0.17.0"))
    for call in (lambda: te_compat.return_layernorm_output(_TELayerNormLinearStandIn(2, 2)),
                 lambda: te_compat.split_layernorm_linear_output(((1, 2), None))):
        with pytest.raises(ImportError, match=r"checked against megatron-core 0\.16\.x, 0\.19\.x only and megatron-core 0\.17\.0 is installed"):
            call()
