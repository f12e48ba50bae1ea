"""Megatron-Bridge hook and the framework-independent runtime both hooks share.

The runtime tests (host ``cu_seqlens`` of NeMo / Bridge batch formats, the in-flight slot ring,
the serialisable layer-spec callable) need only Megatron-Core and run everywhere. The Bridge
``ConfigContainer`` test needs Megatron-Bridge (Python >= 3.12 + Transformer Engine: NVIDIA GPU
containers) and is skipped, with the reason, elsewhere.
"""

import types

import pytest
import torch

from megatron_fastpath._optional import MissingDependencyError, have
from megatron_fastpath.integrations import (
    FastpathLayerSpec,
    FastpathSettings,
    cache_for,
    clear_caches,
    host_cu_seqlens,
)
from megatron_fastpath.packed_seq import Llama3RopeScaling

T = 32


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_caches()
    yield
    clear_caches()


def tiny_config(rotary_base=None, **overrides):
    """A Megatron TransformerConfig; ``rotary_base`` is set as an attribute, as NeMo's GPTConfig
    and Bridge's GPTModelProvider carry it (TransformerConfig itself has no such field)."""
    from megatron_fastpath.model import ModelConfig, build_transformer_config

    config = build_transformer_config(ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128), **overrides)
    if rotary_base is not None:
        config.rotary_base = rotary_base
    return config


# --------------------------------------------------------------------------- host cu_seqlens
@pytest.mark.parametrize(
    "batch, lengths",
    [
        # NeMo 2 / Bridge <= 0.5 collate: -1 padded, argmin precomputed on the host.
        ({"cu_seqlens": torch.tensor([[0, 5, 12, 32, -1, -1]], dtype=torch.int32),
          "cu_seqlens_argmin": torch.tensor([[4]])}, [5, 7, 20]),
        # pad_cu_seqlens=True: repeats of the total before the -1 sentinels.
        ({"cu_seqlens": torch.tensor([[0, 5, 12, 32, 32, 32, -1]], dtype=torch.int32),
          "cu_seqlens_argmin": torch.tensor([[6]])}, [5, 7, 20]),
        # No argmin: the first -1 is found on the host.
        ({"cu_seqlens": torch.tensor([[0, 9, 32, -1]], dtype=torch.int32)}, [9, 23]),
        # Bridge >= 0.6: exact boundaries edge-padded with repeats; physical offsets preferred.
        ({"cu_seqlens_q": torch.tensor([[0, 4, 10, 10]], dtype=torch.int32),
          "cu_seqlens_q_padded": torch.tensor([[0, 8, 16, 16]], dtype=torch.int32)}, [8, 8]),
        ({"cu_seqlens_q": torch.tensor([0, 4, 10], dtype=torch.int32)}, [4, 6]),
        # The packed collate closes its padding tail with a boundary at max_length; its host
        # token_count says where the real tokens end, so the tail is padding again.
        ({"cu_seqlens": torch.tensor([[0, 5, 12, 20, 32, -1]], dtype=torch.int32),
          "cu_seqlens_argmin": torch.tensor([[5]]), "token_count": [20]}, [5, 7, 8]),
        ({"cu_seqlens": torch.tensor([[0, 5, 12, 20, 32, 32, 32, -1]], dtype=torch.int32),
          "cu_seqlens_argmin": torch.tensor([[7]]), "token_count": [20]}, [5, 7, 8]),
        ({"cu_seqlens": torch.tensor([[0, 5, 12, 32, -1]], dtype=torch.int32),
          "cu_seqlens_argmin": torch.tensor([[4]]), "token_count": [32]}, [5, 7, 20]),
    ],
    ids=["nemo", "nemo_pad_cu_seqlens", "no_argmin", "bridge_padded", "bridge_exact",
         "collate_tail", "collate_tail_pad_cu_seqlens", "collate_full"],
)
def test_host_cu_seqlens_formats_load_into_the_cache(batch, lengths):
    settings = FastpathSettings(max_tokens=T, max_seqs=8)
    cache, ring = cache_for(settings, tiny_config(), device="cpu")
    pb = ring.acquire(cu_seqlens=host_cu_seqlens(batch))
    assert pb.lengths_N.tolist() == lengths
    assert cache.current.num_tokens == sum(lengths)
    # padding (MoE routing skips it) exactly where no sequence is
    assert pb.padding_mask_1T[0].tolist() == [i >= sum(lengths) for i in range(T)]


@pytest.mark.parametrize(
    "batch, error, match",
    [
        ({"cu_seqlens": torch.tensor([[0, 4, -1]], device="meta")}, TypeError, "device-to-host sync"),
        ({"cu_seqlens": torch.tensor([[0, 4, -1], [0, 3, -1]])}, ValueError, "micro_batch_size must be 1"),
        ({"tokens": torch.zeros(1, T)}, ValueError, "no cu_seqlens"),
    ],
    ids=["device", "mbs2", "unpacked"],
)
def test_host_cu_seqlens_refusals(batch, error, match):
    with pytest.raises(error, match=match):
        host_cu_seqlens(batch)


def test_in_flight_ring_releases_in_call_order():
    settings = FastpathSettings(max_tokens=T, max_seqs=4, num_slots=2)
    cache, ring = cache_for(settings, tiny_config(), device="cpu")
    assert ring.release == "call_order"
    a = ring.acquire(cu_seqlens=[0, 10, 32])
    b = ring.acquire(cu_seqlens=[0, 16, 32])
    assert (a.slot, b.slot) == (0, 1) and cache.slots[0].busy and cache.slots[1].busy
    c = ring.acquire(cu_seqlens=[0, 32])  # releases a (the oldest), reuses its slot
    assert c.slot == 0 and [h.version for h in ring.held] == [b.version, c.version]
    assert b.packed_seq_params is cache.slots[1].params and cache.slots[1].busy  # b is still held
    ring.release_all()
    assert not any(slot.busy for slot in cache.slots)
    with pytest.raises(RuntimeError, match="no PackedSeqCache exists"):
        cache_for(FastpathSettings(max_tokens=T, max_seqs=3))


def test_cache_registry_refuses_a_different_model_with_the_same_settings():
    settings = FastpathSettings(max_tokens=T, max_seqs=4)
    first, _ = cache_for(settings, tiny_config(), device="cpu")
    again, _ = cache_for(settings, tiny_config(), device="cpu")
    assert again is first
    with pytest.raises(ValueError, match="different RoPE/device"):
        cache_for(settings, tiny_config(rotary_base=500000.0), device="cpu")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=8, max_seqs=9), "max_seqs=9 > max_tokens=8"),
        (dict(max_tokens=8, max_seqs=0), "max_seqs must be a positive int"),
        (dict(max_tokens=8, max_seqs=2, linear_impl="fp8"), "linear_impl must be one of"),
        (dict(max_tokens=8, max_seqs=2, moe_expert_backend="x"), "moe_expert_backend must be one of"),
    ],
)
def test_settings_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FastpathSettings(**kwargs)


# --------------------------------------------------------------------------- layer-spec callable
def test_layer_spec_callable_on_a_plain_transformer_config():
    from megatron_fastpath.attention.core_attention import PackedCoreAttention
    from megatron_fastpath.attention.self_attention import CachedRopeSelfAttention

    config = tiny_config(rotary_base=500000.0)
    settings = FastpathSettings(max_tokens=T, max_seqs=4)
    spec = FastpathLayerSpec(settings)(config)
    attn = spec.submodules.self_attention
    assert attn.module is CachedRopeSelfAttention
    assert attn.submodules.core_attention.module is PackedCoreAttention
    cache = attn.submodules.core_attention.params["cache"]
    assert cache is cache_for(settings)[0]
    assert cache.config.rope.dim == 16 and cache.config.rope.base == 500000.0
    assert FastpathLayerSpec(FastpathSettings(max_tokens=T, max_seqs=4, rope=False))(config) is not None
    assert cache_for(FastpathSettings(max_tokens=T, max_seqs=4, rope=False))[0].config.rope is None


def test_layer_spec_without_cache_swaps_only_the_moe_layer(mcore_parallel):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_fastpath.moe.layer import FastpathMoELayer
    from megatron_fastpath.model import ModelConfig, build_transformer_config

    moe = build_transformer_config(
        ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_experts=4, moe_ffn_hidden_size=64)
    )
    settings = FastpathSettings(max_tokens=T, max_seqs=4, packed_cache=False)
    spec = FastpathLayerSpec(settings)(moe)
    assert spec.submodules.self_attention.module is SelfAttention
    assert spec.submodules.mlp.module is FastpathMoELayer
    assert spec.submodules.pre_mlp_layernorm is not IdentityOp  # MoE needs its own pre-MLP norm
    model = GPTModel(moe, spec, vocab_size=64, max_sequence_length=T, position_embedding_type="none")
    assert all(type(layer.mlp) is FastpathMoELayer for layer in model.decoder.layers)
    with pytest.raises(ValueError, match="only swaps the MoE layer"):
        FastpathLayerSpec(settings)(tiny_config())


# --------------------------------------------------------------------------- Bridge itself
def test_bridge_module_imports_without_bridge_and_says_why():
    from megatron_fastpath.integrations import bridge

    if have("megatron.bridge"):  # pragma: no cover - Bridge containers
        pytest.skip("Megatron-Bridge is installed here")
    with pytest.raises(MissingDependencyError, match=r"'megatron-bridge' \(Python >= 3\.12 and Transformer Engine"):
        bridge.apply_fastpath_to_config(types.SimpleNamespace())


def test_bridge_config_container_hook():  # pragma: no cover - needs Megatron-Bridge
    pytest.importorskip(
        "megatron.bridge",
        reason="Megatron-Bridge is not installed (it needs Python >= 3.12 and Transformer Engine: "
        "NVIDIA's GPU containers); the ConfigContainer hook is exercised there",
    )
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.peft.lora import LoRA
    from megatron.bridge.training.mixed_precision import MixedPrecisionConfig

    try:  # Bridge <= 0.5
        from megatron.bridge.data.datasets.packed_sequence import PackedSequenceSpecs
    except ImportError:  # Bridge >= 0.6
        from megatron.bridge.data.packing.config import PackedSequenceSpecs

    from megatron_fastpath.attention.core_attention import PackedCoreAttention
    from megatron_fastpath.integrations.bridge import (
        BridgeConfigNotSupportedError,
        FastpathForwardStep,
        apply_fastpath_to_config,
    )

    def make_cfg(**model_overrides):
        model = GPTModelProvider(
            num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
            num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True,
            add_bias_linear=False, position_embedding_type="rope", rotary_base=500000,
            vocab_size=128, seq_length=64, **model_overrides,
        )
        specs = PackedSequenceSpecs(packed_sequence_size=64, pad_cu_seqlens=True)
        dataset = types.SimpleNamespace(packed_sequence_specs=specs, dataset_kwargs=None)
        return types.SimpleNamespace(
            model=model, dataset=dataset, train=types.SimpleNamespace(micro_batch_size=1),
            mixed_precision=MixedPrecisionConfig(), peft=LoRA(target_modules=["linear_qkv", "linear_proj"]),
        )

    cfg, step = apply_fastpath_to_config(make_cfg(), cuda_graphs=True, max_seqs=8)
    assert isinstance(step, FastpathForwardStep) and step.settings.max_tokens == 64
    assert isinstance(cfg.model.transformer_layer_spec, FastpathLayerSpec)
    assert cfg.model.position_embedding_type == "none"
    assert cfg.model.cuda_graph_impl == "local" and cfg.model.use_te_rng_tracker is True
    assert cfg.dataset.packed_sequence_specs.pad_cu_seqlens is False
    assert cfg.dataset.dataset_kwargs == {"pad_to_max_length": True}
    spec = cfg.model.transformer_layer_spec(cfg.model)
    assert spec.submodules.self_attention.submodules.core_attention.module is PackedCoreAttention
    with pytest.raises(BridgeConfigNotSupportedError, match="context_parallel_size=2"):
        apply_fastpath_to_config(make_cfg(context_parallel_size=2))


# --------------------------------------------------------------------------- the shared core
def test_rope_config_of_reads_every_rotary_field_megatron_reads():
    """One RopeConfig-from-TransformerConfig function; its inverse frequencies equal Megatron's
    RotaryEmbedding built from the same fields (interleaving, interpolation, Llama 3.1)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_fastpath.model import rope_config_of

    config = tiny_config(rotary_base=500000.0, rotary_interleaved=True)
    config.rotary_percent, config.seq_len_interpolation_factor = 0.5, 2.0
    config.rope_scaling, config.rope_scaling_factor = True, 16.0
    rope = rope_config_of(config)
    assert (rope.dim, rope.base, rope.interleaved, rope.seq_len_interpolation_factor,
            rope.llama3) == (8, 500000.0, True, 2.0, Llama3RopeScaling(16.0))
    ref = RotaryEmbedding(kv_channels=16, rotary_percent=0.5, rotary_interleaved=True,
                          seq_len_interpolation_factor=2.0, rotary_base=500000, rope_scaling=True,
                          rope_scaling_factor=16.0, use_cpu_initialization=True)
    assert torch.equal(rope.inv_freq(), ref.inv_freq)


def _facts(model, **overrides):
    from megatron_fastpath.integrations import core

    fields = dict(names=core.NAMES["bridge"], model=model, custom_layer_spec=None,
                  build_override=None, llama31_rope=None, context_parallel_size=1,
                  virtual_pipeline_size=None, pipeline_size=1, packed_size=T, micro_batch_size=1,
                  graphs_on=False, has_precision=True, fp8_on=False, peft=None)
    fields.update(overrides)
    return core.ModelFacts(**fields)


def test_graphs_never_get_the_host_reading_te_grouped_experts():
    """TE GroupedLinear experts read the group sizes to the host inside the captured MoE
    layer (``tokens_per_expert.tolist()`` for TE's m_splits): with FP8 and CUDA graphs the
    hooks choose grouped_mm by default, and an explicit te_grouped_linear with graphs is
    refused."""
    from megatron_fastpath.integrations import core

    moe = tiny_config(num_moe_experts=4, moe_ffn_hidden_size=64)
    for graphs_on, want in ((False, "te_grouped_linear"), (True, "grouped_mm")):
        plan = core.plan(_facts(moe, graphs_on=graphs_on), core.HookRequest(fp8="hybrid"))
        assert plan.settings["moe_expert_backend"] == want
    plan = core.plan(_facts(moe), core.HookRequest(fp8="hybrid", cuda_graphs=True))
    assert plan.settings["moe_expert_backend"] == "grouped_mm"
    reasons = core.refusals(_facts(moe, graphs_on=True),
                            core.HookRequest(fp8="hybrid", moe_expert_backend="te_grouped_linear"))
    assert [r for r in reasons if "te_grouped_linear experts with CUDA graphs" in r]
    assert not core.refusals(_facts(moe), core.HookRequest(fp8="hybrid", moe_expert_backend="te_grouped_linear"))


@pytest.mark.parametrize("bf16,capability,refused", [
    (True, (9, 0), False), (True, (10, 0), False), (True, (8, 0), True), (False, (9, 0), True)])
def test_hooks_refuse_graphs_where_grouped_mm_syncs(monkeypatch, bf16, capability, refused):
    """The hooks' shared rules: with graphs on, the grouped_mm experts need bf16 on
    sm90 / sm100 (stand-in CUDA of the given capability); the same reason as the main job."""
    from megatron_fastpath.integrations import core

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    moe = tiny_config(num_moe_experts=4, moe_ffn_hidden_size=64)
    moe.bf16 = bf16
    reasons = core.refusals(_facts(moe, graphs_on=True), core.HookRequest())
    found = [r for r in reasons if "torch._grouped_mm's sync-free path" in r]
    assert bool(found) == refused, reasons
    assert not [r for r in core.refusals(_facts(moe), core.HookRequest())
                if "sync-free path" in r]  # graphs off: nothing to capture


def test_core_rules_once_for_both_hooks():
    """The rules of both hooks (fp8 value, MoE bias / expert TP) hold for the Bridge facts as
    for NeMo's; every reason at once; the plan carries Llama 3.1 scaling and keeps rope."""
    from megatron_fastpath.integrations import core

    moe = tiny_config(num_moe_experts=4, moe_ffn_hidden_size=64)
    moe.add_bias_linear, moe.expert_tensor_parallel_size = True, 2  # as a provider may hold them
    reasons = core.refusals(_facts(moe), core.HookRequest(fp8="e5m2", moe_expert_backend="x"))
    assert len(reasons) == 4
    assert any("add_bias_linear must be False" in r for r in reasons)
    assert any("expert_tensor_parallel_size > 1" in r for r in reasons)
    assert any("fp8 must be None, False, 'hybrid' or 'e4m3'" in r for r in reasons)
    assert any("moe_expert_backend must be" in r for r in reasons)
    with pytest.raises(ValueError, match="add_bias_linear"):
        core.decide(_facts(moe), core.HookRequest(), ValueError)

    dense = tiny_config()
    dense.position_embedding_type = "rope"
    scaling = Llama3RopeScaling(32, high_freq_factor=2.0, original_max_position=4096)
    plan = core.plan(_facts(dense, llama31_rope=scaling), core.HookRequest(max_seqs=4))
    assert plan.position_embedding_type is None  # the framework's override rescales Megatron's
    assert plan.settings["llama3_scaling_factor"] == 32.0 and plan.settings["max_seqs"] == 4
    assert plan.settings["llama3_high_freq_factor"] == 2.0
    assert plan.settings["llama3_original_max_position"] == 4096
    assert core.plan(_facts(dense), core.HookRequest()).position_embedding_type == "none"
    FastpathSettings(**plan.settings)
    cache, _ = cache_for(FastpathSettings(**plan.settings), dense, device="cpu")
    assert cache.config.rope.llama3 == scaling


def test_fastpath_settings_read_their_flat_llama3_fields_as_one_scaling():
    """NeMo-Run serialises the flat llama3_* fields to YAML; they are read as one
    Llama3RopeScaling (llama3_fields is the inverse), and bad values are refused when the
    settings are made, not when the model is built."""
    scaling = Llama3RopeScaling(8.0, low_freq_factor=2.0, high_freq_factor=3.0, original_max_position=4096)
    settings = FastpathSettings(max_tokens=T, max_seqs=4, **FastpathSettings.llama3_fields(scaling))
    assert settings.llama3_rope == scaling and settings.llama3_low_freq_factor == 2.0
    assert FastpathSettings(max_tokens=T, max_seqs=4).llama3_rope is None
    assert FastpathSettings.llama3_fields(None) == {}
    with pytest.raises(ValueError, match=r"FastpathSettings.llama3_\* \(Llama 3.1 RoPE scaling\): "
                                         r"Llama3RopeScaling.low_freq_factor=4.0 is not below"):
        FastpathSettings(max_tokens=T, max_seqs=4, llama3_scaling_factor=8.0, llama3_low_freq_factor=4.0)
