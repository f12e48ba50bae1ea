"""NeMo 2 recipe hook on real ``nemo-toolkit[llm]`` 2.7 recipes: the hooked config values, its
NeMo-Run / NeMo-io serialised forms, refusals with reasons, the layers NeMo builds from it, and
NeMo's own packed-sequence collate feeding the cache (per-sequence equality, 0 host syncs).

Needs NeMo 2 + NeMo-Run (``pip install torch==2.13.0 megatron-core==0.16.1
'nemo-toolkit[llm]==2.7.*' 'nemo_run==0.11.*' 'pyarrow==21.*' 'leptonai==0.26.*'``): skipped, with
the reason, without them.
"""

import copy
import dataclasses
import json

import numpy as np
import pytest

pytestmark = pytest.mark.nemo  # CI's legacy target (Python 3.11) runs these: NeMo 2.7 installs there only
import torch

llm = pytest.importorskip(
    "nemo.collections.llm",
    reason="NeMo 2 is not installed (pip install torch==2.13.0 megatron-core==0.16.1 "
    "'nemo-toolkit[llm]==2.7.*' 'nemo_run==0.11.*' 'pyarrow==21.*' 'leptonai==0.26.*'); "
    "the NeMo recipe hook tests need it",
)
run = pytest.importorskip("nemo_run", reason="nemo_run (NeMo-Run recipes) is not installed")
import fiddle as fdl  # noqa: E402  (installed with nemo_run)

from megatron_fastpath.integrations import FastpathLayerSpec, FastpathSettings, cache_for, clear_caches  # noqa: E402
from megatron_fastpath.integrations.nemo import (  # noqa: E402
    FastpathDataStep,
    FastpathForwardStep,
    RecipeNotSupportedError,
    apply_fastpath,
    max_seqs_from_pack_metadata,
)
from megatron_fastpath.packed_seq import Llama3RopeScaling  # noqa: E402
from megatron_fastpath.sync import SyncSentinel  # noqa: E402

T = 64  # packed_sequence_size of the tiny models
VOCAB = 128
EOS = 0


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_caches()
    yield
    clear_caches()


def recipe(kind="llama3_8b", tmp="/tmp/mf_nemo_recipes", gpus=1, **kwargs):
    kwargs.setdefault("peft_scheme", "lora")
    kwargs.setdefault("packed_sequence", True)
    return getattr(llm, kind).finetune_recipe(
        name=f"t_{kind}", dir=tmp, num_nodes=1, num_gpus_per_node=gpus, **kwargs
    )


def make_tiny(r, **extra):
    """Shrink a recipe's model to a CPU-buildable size (fp32, no TE fusions), packs of T."""
    r.data.packed_sequence_specs.packed_sequence_size = T
    r.data.seq_length = T
    fields = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, vocab_size=VOCAB, seq_length=T, apply_rope_fusion=False,
        bias_activation_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        cross_entropy_loss_fusion=False, use_cpu_initialization=True,
        params_dtype=torch.float32, bf16=False, hidden_dropout=0.0, attention_dropout=0.0,
    )
    fields.update(extra)
    for k, v in fields.items():
        setattr(r.model.config, k, v)
    return r


def build_model(r):
    model = fdl.build(r.model)
    model.configure_model()
    return model


# --------------------------------------------------------------------------- config values
def test_llama3_lora_packed_recipe_is_hooked():
    r = recipe()
    before = copy.deepcopy(r)
    out = apply_fastpath(r, cuda_graphs=True, max_seqs=96)
    assert out is r
    cfg = r.model.config
    settings = fdl.build(cfg.transformer_layer_spec.settings)
    assert fdl.get_callable(cfg.transformer_layer_spec) is FastpathLayerSpec
    assert settings == FastpathSettings(
        max_tokens=4096, max_seqs=96, num_slots=1, attention_backend="auto", linear_impl=None,
        moe_expert_backend="grouped_mm", rope=True, packed_cache=True,
    )
    assert fdl.get_callable(cfg.data_step_fn) is FastpathDataStep
    assert fdl.build(cfg.data_step_fn.settings) == settings
    assert fdl.get_callable(cfg.forward_step_fn) is FastpathForwardStep
    assert cfg.position_embedding_type == "none"  # RoPE from the cache
    assert cfg.enable_cuda_graph is True and cfg.use_te_rng_tracker is True
    # LoRA freezes the embedding: megatron-core 0.16.1's capture warm-up would fail (rules.py)
    assert cfg.cuda_graph_warmup_steps == 0
    assert r.data.packed_sequence_specs.pad_cu_seqlens is False
    assert r.data.dataset_kwargs == {"pad_to_max_length": True}
    # Exactly these model-config fields changed; rotary settings the cache reads stay put.
    changed = {
        k for k in set(cfg.__arguments__) | set(before.model.config.__arguments__)
        if cfg.__arguments__.get(k, "<unset>") != before.model.config.__arguments__.get(k, "<unset>")
    }
    assert changed == {
        "transformer_layer_spec", "data_step_fn", "forward_step_fn", "position_embedding_type",
        "enable_cuda_graph", "use_te_rng_tracker", "cuda_graph_warmup_steps",
    }
    assert cfg.rotary_base == 500_000 and cfg.seq_length == 4096
    # LoRA, trainer and optimiser untouched.
    assert r.peft == before.peft and r.trainer == before.trainer and r.optim == before.optim


def test_hooked_recipe_serialises_and_round_trips():
    from nemo_run.core.serialization.yaml import YamlSerializer
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    r = apply_fastpath(recipe(), cuda_graphs=True, max_seqs=96)
    # ZlibJSON is what NeMo-Run ships to an executor: the whole recipe round-trips exactly.
    z = ZlibJSONSerializer()
    back = z.deserialize(z.serialize(r))
    assert back == r
    assert fdl.build(back.model.config.transformer_layer_spec) == FastpathLayerSpec(
        fdl.build(r.model.config.transformer_layer_spec.settings)
    )
    # The YAML form names our classes by import path and loads back to the same model config.
    y = YamlSerializer()
    text = y.serialize(r.model)
    assert "_target_: megatron_fastpath.integrations._runtime.FastpathLayerSpec" in text
    assert "_target_: megatron_fastpath.integrations.nemo.FastpathDataStep" in text
    assert "_target_: megatron_fastpath.integrations.nemo.FastpathForwardStep" in text
    assert "max_seqs: 96" in text and "position_embedding_type: none" in text
    assert y.deserialize(text) == r.model


def test_mixtral_moe_recipe_lora_and_fp8():
    r = recipe("mixtral_8x7b", gpus=8)
    assert r.peft.target_modules == ["linear_qkv", "linear_proj"]  # NeMo's MoE LoRA default
    apply_fastpath(r, fp8="hybrid", fp8_recipe="tensorwise")
    settings = fdl.build(r.model.config.transformer_layer_spec.settings)
    assert settings.max_tokens == 2048 and settings.max_seqs == 2048
    assert settings.linear_impl == "te" and settings.moe_expert_backend == "te_grouped_linear"
    assert r.trainer.plugins.fp8 == "hybrid" and r.trainer.plugins.fp8_recipe == "tensorwise"
    assert r.model.config.fp8 == "hybrid"
    assert r.model.config.__arguments__.get("enable_cuda_graph") is None  # cuda_graphs=None keeps it

    r2 = apply_fastpath(recipe("mixtral_8x7b", gpus=8), lora=["linear_qkv"])
    assert r2.peft.target_modules == ["linear_qkv"]
    assert fdl.build(r2.model.config.transformer_layer_spec.settings).moe_expert_backend == "grouped_mm"

    # packed_cache=False: only the MoE layer is swapped; NeMo's data/forward steps and RoPE stay.
    r3 = recipe("mixtral_8x7b", gpus=8, packed_sequence=False)
    apply_fastpath(r3, packed_cache=False)
    s3 = fdl.build(r3.model.config.transformer_layer_spec.settings)
    assert s3.packed_cache is False and s3.rope is False
    assert {"data_step_fn", "forward_step_fn", "position_embedding_type"}.isdisjoint(r3.model.config.__arguments__)

    with pytest.raises(RecipeNotSupportedError, match=r"LoRA on \['linear_fc1'\] in an MoE model"):
        apply_fastpath(recipe("mixtral_8x7b", gpus=8), lora=["linear_qkv", "linear_fc1"])


@pytest.mark.parametrize("kind, factor", [("llama31_8b", 8.0), ("llama32_1b", 32.0), ("llama32_3b", 32.0)])
def test_llama31_and_llama32_recipes_are_hooked_with_their_rope_scaling(kind, factor):
    """NeMo's Llama31Config rescales Megatron's rotary embedding in configure_model; the hook
    carries the scaling into the cache's RoPE and keeps position_embedding_type='rope' (the
    override needs the embedding it rescales; it is computed once and not used)."""
    from nemo_run.core.serialization.yaml import YamlSerializer

    r = recipe(kind)
    before = copy.deepcopy(r)
    apply_fastpath(r, max_seqs=96)
    settings = fdl.build(r.model.config.transformer_layer_spec.settings)
    assert (settings.llama3_scaling_factor, settings.llama3_low_freq_factor,
            settings.llama3_high_freq_factor, settings.llama3_original_max_position) == (factor, 1.0, 4.0, 8192)
    assert settings.llama3_rope == Llama3RopeScaling(factor)
    assert settings.rope is True and settings.max_seqs == 96
    assert "position_embedding_type" not in r.model.config.__arguments__
    changed = {k for k in r.model.config.__arguments__
               if r.model.config.__arguments__[k] != before.model.config.__arguments__.get(k, "<unset>")}
    assert changed == {"transformer_layer_spec", "data_step_fn", "forward_step_fn"}
    y = YamlSerializer()
    assert y.deserialize(y.serialize(r.model)) == r.model
    unscaled = apply_fastpath(recipe("llama3_8b"))
    assert fdl.build(unscaled.model.config.transformer_layer_spec.settings).llama3_scaling_factor is None


@pytest.mark.parametrize("kind", ["llama31_8b", "llama32_1b"])
def test_hooked_tiny_llama31_cache_rope_equals_nemos_scaled_rotary_embedding(mcore_parallel, kind):
    """The cache's inverse frequencies equal those NeMo's configure_model wrote into the
    model's Megatron RotaryEmbedding (nemo.collections.llm.gpt.model.llama.apply_rope_scaling)."""
    from megatron_fastpath.attention.core_attention import PackedCoreAttention

    r = apply_fastpath(make_tiny(recipe(kind), kv_channels=64), max_seqs=16)
    model = build_model(r)
    assert all(type(layer.self_attention.core_attention) is PackedCoreAttention
               for layer in model.module.decoder.layers)
    cache, _ = cache_for(fdl.build(r.model.config.transformer_layer_spec.settings))
    nemo_inv_freq = model.module.rotary_pos_emb.inv_freq
    assert cache.config.rope.dim == 64 and cache.config.rope.base == 500_000.0
    assert torch.equal(cache.config.rope.inv_freq(), nemo_inv_freq)
    assert not torch.equal(dataclasses.replace(cache.config.rope, llama3=None).inv_freq(),
                           nemo_inv_freq)


def _cp2():
    r = recipe()
    r.trainer.strategy.context_parallel_size = 2
    return r


def _vpp():
    r = recipe()
    r.trainer.strategy.pipeline_model_parallel_size = 2
    r.trainer.strategy.virtual_pipeline_model_parallel_size = 2
    return r


def _canonical_lora():
    r = recipe()
    r.peft = run.Config(llm.peft.CanonicalLoRA)
    return r


def _local_attention():
    from megatron.core.transformer.enums import AttnBackend

    r = recipe()
    r.model.config.attention_backend = AttnBackend.local
    return r


def _full_iteration_graph():
    r = recipe()
    r.model.config.cuda_graph_scope = "full_iteration"
    return r


@pytest.mark.parametrize(
    "make, kwargs, match",
    [
        (lambda: recipe("deepseek_v2_lite"), {}, r"multi-latent attention \(MLA"),
        (lambda: recipe("gemma2_2b"), {}, r"sliding-window attention"),
        (lambda: llm.t5_220m.finetune_recipe(name="t5", dir="/tmp/mf_nemo_recipes", num_nodes=1,
                                             num_gpus_per_node=1), {}, r"T5Model is not a NeMo GPTModel"),
        (lambda: recipe(packed_sequence=False), {}, r"packed_cache=True needs packed sequences"),
        (lambda: recipe(packed_sequence=False, peft_scheme=None), {"packed_cache": False},
         r"packed_cache=False on a dense model leaves nothing"),
        (_cp2, {}, r"context_parallel_size=2"),
        (_cp2, {"packed_cache": False, "fp8": "hybrid"},
         r"context_parallel_size=2 with packed_cache=False in float32: Transformer Engine's attention"),
        (_vpp, {}, r"virtual \(interleaved\) pipeline parallelism"),
        (_canonical_lora, {}, r"PEFT scheme CanonicalLoRA is not supported"),
        (lambda: recipe(peft_scheme=None), {"lora": ["linear_qkv"]}, r"the recipe has no PEFT"),
        (recipe, {"lora": ["linear_q"]}, r"LoRA target modules \['linear_q'\]"),
        (_local_attention, {}, r"attention_backend=local"),
        (_full_iteration_graph, {"cuda_graphs": True}, r"full_iteration"),
        (recipe, {"fp8": "e5m2"}, r"fp8 must be None, False, 'hybrid' or 'e4m3'"),
        (recipe, {"max_seqs": 5000}, r"max_seqs=5000 must be in \[1, packed_sequence_size=4096\]"),
        (recipe, {"attention_backend": "xformers"}, None),
    ],
    ids=["deepseek_mla", "gemma2", "t5", "unpacked", "nothing_to_do", "cp2", "cp2_fp32_te_attention", "vpp",
         "canonical_lora", "lora_no_peft", "lora_target", "local_attn", "full_iter_graph",
         "fp8_format", "max_seqs", "backend"],
)
def test_refused_recipes_with_reason_and_unchanged(make, kwargs, match):
    r = make()
    before = copy.deepcopy(r)
    if match is None:  # a bad setting value: refused by FastpathSettings before any change
        with pytest.raises(ValueError, match="attention_backend must be one of"):
            apply_fastpath(r, **kwargs)
    else:
        with pytest.raises(RecipeNotSupportedError, match=match) as info:
            apply_fastpath(r, **kwargs)
        assert info.value.reasons and all(isinstance(s, str) for s in info.value.reasons)
    assert r == before


def test_refusal_lists_every_reason_and_double_application():
    from megatron.core.transformer.enums import AttnBackend

    r = _cp2()
    r.model.config.attention_backend = AttnBackend.local
    with pytest.raises(RecipeNotSupportedError) as info:
        apply_fastpath(r)
    assert len(info.value.reasons) == 2
    hooked = apply_fastpath(recipe())
    with pytest.raises(RecipeNotSupportedError, match="already applied"):
        apply_fastpath(hooked)
    with pytest.raises(TypeError, match="expects a NeMo-Run recipe"):
        apply_fastpath(run.Config(llm.Llama3Config8B))


def test_pipeline_parallel_sets_slots():
    r = recipe()
    r.trainer.strategy.pipeline_model_parallel_size = 4
    apply_fastpath(r)
    assert fdl.build(r.model.config.transformer_layer_spec.settings).num_slots == 4


def test_max_seqlen_from_pack_metadata_bounds_the_cache(tmp_path, mcore_parallel):
    """The hooks' sequence bound, as the main job's: it comes from NeMo's packing metadata
    (dataset_max_seqlen, rounded up to 64, capped at the pack size), not from T."""
    from megatron_fastpath.integrations.nemo import max_seqlen_from_pack_metadata

    meta = tmp_path / "metadata.json"
    meta.write_text(json.dumps([{"dataset_max_seqlen": 100, "max_samples_per_bin": 9, "pack_size": 4096},
                                {"dataset_max_seqlen": 130, "max_samples_per_bin": 7, "pack_size": 4096}]))
    assert max_seqlen_from_pack_metadata(meta) == 192
    meta.write_text(json.dumps([{"dataset_max_seqlen": 4000, "max_samples_per_bin": 1, "pack_size": 4000}]))
    assert max_seqlen_from_pack_metadata(meta) == 4000
    meta.write_text(json.dumps([{"max_samples_per_bin": 1}]))
    with pytest.raises(ValueError, match="with dataset_max_seqlen"):
        max_seqlen_from_pack_metadata(meta)

    r = apply_fastpath(make_tiny(recipe()), max_seqs=16, max_seqlen=32)
    settings = fdl.build(r.model.config.transformer_layer_spec.settings)
    assert settings.max_seqlen == 32
    build_model(r)
    cache, _ = cache_for(settings)
    assert cache.config.max_seqlen == 32 and cache.config.max_seqlen_bound == 32
    with pytest.raises(RecipeNotSupportedError, match=r"max_seqlen=65 must be in \[1, packed_sequence_size=64\]"):
        apply_fastpath(make_tiny(recipe()), max_seqlen=65)


# --------------------------------------------------------------------------- built models
def test_hooked_tiny_llama_builds_fastpath_layers_and_nemo_io(mcore_parallel, tmp_path):
    from nemo.lightning import io

    from megatron_fastpath.attention.core_attention import PackedCoreAttention
    from megatron_fastpath.attention.self_attention import CachedRopeSelfAttention

    r = apply_fastpath(make_tiny(recipe()), max_seqs=16)
    model = build_model(r)
    layers = model.module.decoder.layers
    assert len(layers) == 2
    for layer in layers:
        assert type(layer.self_attention) is CachedRopeSelfAttention
        assert type(layer.self_attention.core_attention) is PackedCoreAttention
        assert layer.self_attention.core_attention.backend == "sdpa"  # auto on CPU
    assert not hasattr(model.module, "rotary_pos_emb")  # RoPE comes from the cache
    settings = fdl.build(r.model.config.transformer_layer_spec.settings)
    cache, _ = cache_for(settings)
    assert layers[0].self_attention.core_attention.cache is cache
    assert cache.config.rope.dim == 16 and cache.config.rope.base == 500_000.0
    assert (cache.config.max_tokens, cache.config.max_seqs) == (T, 16)

    # NeMo's checkpoint context (io.json) of the built model loads back with our callables.
    model.io_dump(tmp_path, yaml_attrs=["config"])
    loaded = io.load_context(tmp_path, subpath=None)
    assert loaded.config.transformer_layer_spec == FastpathLayerSpec(settings)
    assert loaded.config.data_step_fn == FastpathDataStep(settings)
    # the loss the hook's plan resolved: the tiny model's logits are far under the chunked
    # loss's threshold (rules.LINEAR_CROSS_ENTROPY_MIN_LOGITS), so the default rule says off
    assert loaded.config.forward_step_fn == FastpathForwardStep(linear_cross_entropy="off")
    assert "FastpathLayerSpec" in (tmp_path / "config.yaml").read_text()


def test_hooked_tiny_mixtral_builds_fastpath_moe(mcore_parallel):
    from megatron_fastpath._optional import MissingDependencyError, have
    from megatron_fastpath.attention.core_attention import PackedCoreAttention
    from megatron_fastpath.moe.experts import GroupedSwiGLUExperts
    from megatron_fastpath.moe.layer import FastpathMoELayer

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, ffn_hidden_size=64)
    r = apply_fastpath(make_tiny(recipe("mixtral_8x7b"), **moe), max_seqs=16)
    model = build_model(r)
    for layer in model.module.decoder.layers:
        assert type(layer.mlp) is FastpathMoELayer and type(layer.mlp.experts) is GroupedSwiGLUExperts
        assert type(layer.self_attention.core_attention) is PackedCoreAttention

    clear_caches()
    r8 = apply_fastpath(make_tiny(recipe("mixtral_8x7b"), **moe), fp8="hybrid")
    if have("transformer_engine.pytorch"):  # pragma: no cover - GPU machines
        pytest.skip("Transformer Engine is installed: the FP8 spec builds")
    with pytest.raises(MissingDependencyError, match="transformer-engine"):
        fdl.build(r8.model.config.transformer_layer_spec)(model.config)  # same shapes, FP8 settings


# --------------------------------------------------------------------------- NeMo's packed data
@pytest.fixture(scope="module")
def nemo_packed(tmp_path_factory):
    """A packed dataset made by NeMo's own packing (create_hist / create_packing_strategy /
    fill_packing_strategy), its metadata file, and the expected sequence lengths per pack."""
    from nemo.utils.sequence_packing_utils import (
        create_hist,
        create_packing_strategy,
        fill_packing_strategy,
    )

    rng = np.random.default_rng(0)
    samples = []
    for _ in range(14):
        n = int(rng.integers(5, 30))
        samples.append({"input_ids": rng.integers(1, VOCAB, n).tolist(), "answer_start_idx": int(rng.integers(1, n))})
    sequences, histogram = create_hist(np.array(samples), T)
    assignments, metadata = create_packing_strategy(histogram, T)
    packed = fill_packing_strategy(assignments, sequences, T, EOS)
    d = tmp_path_factory.mktemp("nemo_packed")
    np.save(d / "packed.npy", packed)
    (d / "metadata.json").write_text(json.dumps([metadata]))
    expected = []  # the collate's trailing pad (closed by a boundary at T) is padding, not a sequence
    for item in packed:  # NeMo drops the last token of every sequence (input/label shift)
        expected.append(list(np.diff(item["seq_start_id"] + [len(item["input_ids"])]) - 1))
    assert any(sum(lengths) < T for lengths in expected)  # packs with a padding tail are tested
    return d, metadata, expected


def packed_dataset(path, pad_cu_seqlens):
    from nemo.collections.llm.gpt.data.core import GPTSFTPackedDataset

    class Tokenizer:  # the packed collate only reads eos_id
        eos_id = EOS

    return GPTSFTPackedDataset(
        str(path / "packed.npy"), Tokenizer(), max_seq_length=T, pad_to_max_length=True,
        pad_cu_seqlens=pad_cu_seqlens, pack_metadata_file_path=str(path / "metadata.json"),
        prompt_template="{input} {output}", label_key="output", truncation_field="input",
    )


@pytest.mark.parametrize("pad_cu_seqlens", [False, True], ids=["plain", "pad_cu_seqlens"])
def test_data_step_loads_nemo_collate_from_host(mcore_parallel, nemo_packed, pad_cu_seqlens):
    path, metadata, expected = nemo_packed
    assert max_seqs_from_pack_metadata(path / "metadata.json") == metadata["max_samples_per_bin"] + 1
    r = apply_fastpath(make_tiny(recipe()), max_seqs=max_seqs_from_pack_metadata(path / "metadata.json"))
    build_model(r)
    step = fdl.build(r.model.config.data_step_fn)
    cache, _ = cache_for(step.settings)
    ds = packed_dataset(path, pad_cu_seqlens)
    batches = [ds.collate_fn([ds[i]]) for i in range(len(ds))]
    if pad_cu_seqlens:  # NeMo padded the boundaries with repeats of T up to a constant width
        assert {b["cu_seqlens"].shape for b in batches} == {(1, metadata["max_samples_per_bin"] + 3)}
    static_ptr = None
    for b, lengths in zip(batches, expected):
        with SyncSentinel() as s:
            out = step(iter([b]))
        # The only value reads are of the collate's CPU tensors, in _host_row.
        assert [e.op for e in s.events] == ["numpy", "numpy"]
        assert all("_runtime.py" in e.location for e in s.events)
        assert cache.current.lengths_N.tolist() == lengths
        # MoE routing's padding mask: exactly the collate's pad after the real tokens
        assert out["packed_batch"].padding_mask_1T[0].tolist() == [i >= sum(lengths) for i in range(T)]
        assert "cu_seqlens" not in out and "cu_seqlens_argmin" not in out and out["attention_mask"] is None
        params = out["packed_seq_params"]
        assert params.qkv_format == "thd" and params.max_seqlen_q == T
        assert params.cu_seqlens_q.shape == (cache.config.max_seqs + 2,)  # + the tail closed at T
        assert params.cu_seqlens_q_padded is None and params.cu_seqlens_q[-1] == T
        ptr = params.cu_seqlens_q.data_ptr()
        assert static_ptr in (None, ptr)  # one slot: the same static buffer every batch
        static_ptr = ptr
        assert out["position_ids"] is cache.slots[0].position_ids_1T
        assert torch.equal(out["tokens"], b["tokens"]) and torch.equal(out["loss_mask"], b["loss_mask"])


def test_data_step_refuses_wrong_pack_width_and_device_boundaries(mcore_parallel, nemo_packed):
    path, _, _ = nemo_packed
    r = apply_fastpath(make_tiny(recipe()), max_seqs=16)
    build_model(r)
    step = fdl.build(r.model.config.data_step_fn)
    ds = packed_dataset(path, False)
    b = ds.collate_fn([ds[0]])
    short = dict(b, tokens=b["tokens"][:, : T // 2])
    with pytest.raises(ValueError, match=r"the cache needs \[1, 64\]"):
        step(iter([short]))
    meta = dict(b, cu_seqlens=b["cu_seqlens"].to("meta"))
    with pytest.raises(TypeError, match="device-to-host sync"):
        step(iter([meta]))
    clear_caches()
    with pytest.raises(RuntimeError, match="no PackedSeqCache exists"):
        step(iter([b]))


def test_hooked_model_packed_equals_per_sequence_with_zero_syncs(mcore_parallel, nemo_packed):
    path, _, expected = nemo_packed
    r = apply_fastpath(make_tiny(recipe()), max_seqs=16)
    torch.manual_seed(0)
    model = build_model(r)
    step = fdl.build(r.model.config.data_step_fn)
    forward = fdl.build(r.model.config.forward_step_fn)
    ds = packed_dataset(path, False)
    b = ds.collate_fn([ds[0]])

    out = step(iter([b]))
    with SyncSentinel() as s:
        loss_1T = forward(model, out)
        (loss_1T * out["loss_mask"]).sum().backward()
    assert s.num_syncs == 0, s.summary()
    assert loss_1T.shape == (1, T) and torch.isfinite(loss_1T).all()

    # Each sequence alone (padded to T, its own cu_seqlens) gives the same per-token loss.
    starts = np.cumsum([0] + expected[0][:-1])
    for start, n in zip(starts, expected[0]):
        single = {
            "tokens": torch.zeros(1, T, dtype=torch.long),
            "labels": torch.zeros(1, T, dtype=torch.long),
            "loss_mask": torch.zeros(1, T, dtype=torch.long),
            "cu_seqlens": torch.tensor([[0, n, T, -1]] if n < T else [[0, T, -1]], dtype=torch.int32),
        }
        single["cu_seqlens_argmin"] = torch.tensor([[single["cu_seqlens"].shape[1] - 1]])
        for key in ("tokens", "labels", "loss_mask"):
            single[key][0, :n] = b[key][0, start : start + n]
        with torch.no_grad():
            alone_1T = forward(model, step(iter([single])))
        torch.testing.assert_close(alone_1T[0, :n], loss_1T.detach()[0, start : start + n], rtol=1e-5, atol=1e-5)


def test_hooked_tiny_llama31_packed_equals_nemos_own_model_per_sequence(mcore_parallel, nemo_packed,
                                                                        monkeypatch):
    """Llama 3.1 tested like Llama 3, against NeMo's own model: the recipe built without the
    hook (Megatron's attention, RoPE from the rotary module NeMo rescaled), same weights, each
    sequence alone, gives the per-token losses of the hooked model on the packed batch. Megatron's
    rotary module moves itself to CUDA, hence the test-only CUDA-as-CPU mode."""
    import contextlib

    from tests.support.cuda_as_cpu import cuda_as_cpu
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # Megatron's DotProductAttention forks the CUDA RNG tracker for its dropout (0 here).
    monkeypatch.setattr(get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    path, _, expected = nemo_packed
    tiny = dict(kv_channels=64, init_method_std=0.5)  # sharp attention: RoPE scaling shows
    r = apply_fastpath(make_tiny(recipe("llama31_8b"), **tiny), max_seqs=16)
    torch.manual_seed(0)
    model = build_model(r)
    reference = build_model(make_tiny(recipe("llama31_8b"), **tiny))  # NeMo alone
    missing, unexpected = reference.module.load_state_dict(model.module.state_dict(), strict=False)
    assert [k for k in missing + unexpected if not k.endswith("_extra_state")] == []
    step = fdl.build(r.model.config.data_step_fn)
    forward = fdl.build(r.model.config.forward_step_fn)
    ds = packed_dataset(path, False)
    b = ds.collate_fn([ds[0]])
    starts = np.cumsum([0] + expected[0][:-1])
    with cuda_as_cpu(), torch.no_grad():
        loss_1T = forward(model, step(iter([b])))
        for start, n in zip(starts, expected[0]):  # the collate's pad after them is padding
            tokens = b["tokens"][:, start:start + n]
            ref_1n = reference(input_ids=tokens, position_ids=torch.arange(n)[None],
                               attention_mask=None, labels=b["labels"][:, start:start + n])
            torch.testing.assert_close(loss_1T[0, start:start + n], ref_1n[0], rtol=1e-4, atol=1e-4)
        # the check can fail: without the scaling the same comparison is off
        reference.module.rotary_pos_emb.inv_freq = dataclasses.replace(
            cache_for(step.settings)[0].config.rope, llama3=None).inv_freq()
        reference.module.rotary_pos_emb.forward.cache_clear()
        n = expected[0][0]
        off = reference(input_ids=b["tokens"][:, :n], position_ids=torch.arange(n)[None],
                        attention_mask=None, labels=b["labels"][:, :n])
        assert (off[0] - loss_1T[0, :n]).abs().max() > 1e-3  # 10x the tolerance above


# --------------------------------------------------------------------------- one packed runtime
def _bridge_losses_standin(monkeypatch):
    """Megatron-Bridge is not installable here (Python 3.12 + TE): its forward step imports
    ``megatron.bridge.training.losses.masked_next_token_loss`` (signature ``(loss_mask,
    output_tensor, check_for_nan_in_loss=True, check_for_spiky_loss=False)``, Bridge
    ``training/losses.py``) only to return it, unevaluated, beside the model output."""
    import sys
    import types

    def masked_next_token_loss(loss_mask, output_tensor, check_for_nan_in_loss=True,
                               check_for_spiky_loss=False):  # pragma: no cover - never called
        raise AssertionError("the test reads the forward output, not Bridge's loss")

    for name in ("megatron.bridge", "megatron.bridge.training", "megatron.bridge.training.losses"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["megatron.bridge.training.losses"].masked_next_token_loss = masked_next_token_loss


def test_moe_padding_content_changes_nothing_through_every_entry_point(mcore_parallel, nemo_packed,
                                                                     monkeypatch):
    """The NeMo forward step, the Bridge forward step and the main job's forward are one
    function. A MoE model (capacity-limited experts, so routed padding would take real tokens'
    places) gives, through each of them, per-token losses of the real tokens and aux / z losses
    identical to the others and unchanged when only the content of the collate's padding tail
    changes. Before, only the main job passed Megatron's ``padding_mask``."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    from megatron_fastpath.integrations.bridge import FastpathForwardStep as BridgeForwardStep
    from megatron_fastpath.packed_seq.runtime import forward

    _bridge_losses_standin(monkeypatch)
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, ffn_hidden_size=64,
               moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_router_dtype="fp32",
               moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs",
               moe_router_load_balancing_type="aux_loss")
    r = apply_fastpath(make_tiny(recipe("mixtral_8x7b"), **moe), max_seqs=16)
    torch.manual_seed(0)
    model = build_model(r)
    data_step = fdl.build(r.model.config.data_step_fn)
    nemo_forward = fdl.build(r.model.config.forward_step_fn)
    bridge_forward = BridgeForwardStep(data_step.settings)
    state = type("State", (), {"cfg": type("Cfg", (), {"rerun_state_machine": type(
        "Rerun", (), {"check_for_nan_in_loss": True, "check_for_spiky_loss": False})()})()})()
    path, _, expected = nemo_packed
    ds = packed_dataset(path, False)
    k = next(i for i, lengths in enumerate(expected) if sum(lengths) <= T - 8)  # a long pad
    b = ds.collate_fn([ds[k]])
    n_real = sum(expected[k])
    assert b["token_count"] == [n_real]
    # Padding that every router would send to expert 0: the hot token repeated over the tail.
    hot = dict(b, tokens=b["tokens"].clone())
    hot["tokens"][0, n_real:] = 7

    def run(entry, batch):  # with grad, as in training: the router logs its losses then
        clear_aux_losses_tracker()
        if entry == "nemo":
            out = nemo_forward(model, data_step(iter([batch])))
        elif entry == "bridge":
            out, _ = bridge_forward(state, iter([batch]), model.module)
        else:  # the main job's call (train/step.py): lengths from its own packing
            pb = cache_for(data_step.settings)[1].acquire(expected[k])
            out = forward(model.module, pb, batch["tokens"], batch["labels"])
        losses = {name: v["values"].clone() for name, v in get_moe_layer_wise_logging_tracker().items()}
        return out[0, :n_real].detach().clone(), losses

    runs = {(entry, pad): run(entry, batch) for entry in ("nemo", "bridge", "main")
            for pad, batch in (("eos", b), ("hot", hot))}
    ref_loss, ref_aux = runs[("main", "eos")]
    assert set(ref_aux) == {"load_balancing_loss", "z_loss"}
    assert all(float(v.abs().sum()) > 0 for v in ref_aux.values())
    for key, (loss, aux) in runs.items():
        assert torch.equal(loss, ref_loss), key
        assert set(aux) == set(ref_aux) and all(torch.equal(aux[n], ref_aux[n]) for n in aux), key
    # The comparison can fail: the same model without the padding mask routes the hot padding.
    clear_aux_losses_tracker()
    pb = cache_for(data_step.settings)[1].acquire(expected[k] + [T - n_real])  # pad as a sequence
    unmasked = model.module(hot["tokens"], pb.position_ids_1T, None, labels=hot["labels"],
                            packed_seq_params=pb.packed_seq_params)
    lb = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
    assert not torch.equal(lb, ref_aux["load_balancing_loss"])
    assert not torch.equal(unmasked[0, :n_real].detach(), ref_loss)  # capacity: padding took real places


def test_every_entry_point_shares_one_forward_and_one_slot_class():
    """The model call with packed params lives in one module (packed_seq/runtime.py; on
    megatron-core 0.16.1, which has no ``output_processor``, the chunked loss's model call runs
    GPTModel.forward's steps in compat/gpt_output.py, which runtime.py calls) and every entry
    point imports it; the hooks' slot ring is the main job's class."""
    import ast
    import os

    import megatron_fastpath
    from megatron_fastpath.packed_seq.inflight import InFlightBatches

    root = os.path.dirname(megatron_fastpath.__file__)
    calls, users = [], set()
    for dirpath, _, files in os.walk(root):
        for fn in files:
            if not fn.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), root)
            tree = ast.parse(open(os.path.join(dirpath, fn), encoding="utf-8").read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and {"packed_seq_params", "labels"} <= {k.arg for k in node.keywords}:
                    calls.append(rel)
                if (isinstance(node, ast.ImportFrom) and node.module == "megatron_fastpath.packed_seq.runtime"
                        and any(a.name == "forward" for a in node.names)):
                    users.add(rel)
    runtime, shim = os.path.join("packed_seq", "runtime.py"), os.path.join("compat", "gpt_output.py")
    assert set(calls) == {runtime, shim}  # runtime.py: the plain, the chunked and the eval call
    assert users == {os.path.join(*p) for p in (("train", "step.py"), ("train", "evaluate.py"),
                                                ("train", "full_iteration.py"),
                                                ("integrations", "nemo.py"), ("integrations", "bridge.py"))}
    settings = FastpathSettings(max_tokens=T, max_seqs=4)
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    ring = cache_for(settings, tc, device="cpu")[1]
    assert type(ring) is InFlightBatches and ring.release == "call_order"


def test_hook_layer_spec_installs_the_graph_buffer_shim_when_graphs_are_on(mcore_parallel):
    """The main job installs compat.keep_cudagraph_input_buffers (0.16.1 recycles forward-graph
    input buffers: wrong embedding / first-norm gradients); a recipe that turns graphs on gets it
    installed when NeMo builds the model from the hooked spec."""
    from megatron.core.transformer import cuda_graphs as cg

    from megatron_fastpath import compat
    from megatron_fastpath.compat.graphs import restore_cudagraph_input_recycling

    if compat.mcore_line() == (0, 19):  # no reuse pool: 0.19 keeps the buffers, nothing installed
        r = apply_fastpath(make_tiny(recipe()), max_seqs=16, cuda_graphs=True)
        assert r.model.config.enable_cuda_graph
        fdl.build(r.model.config.transformer_layer_spec)(fdl.build(r.model.config))
        assert not hasattr(cg._CudagraphGlobalRecord, "tensor_reuse_pool")
        return
    restore_cudagraph_input_recycling()
    try:
        r = apply_fastpath(make_tiny(recipe()), max_seqs=16)
        assert not r.model.config.enable_cuda_graph
        fdl.build(r.model.config.transformer_layer_spec)(fdl.build(r.model.config))
        assert type(cg._CudagraphGlobalRecord.tensor_reuse_pool) is cg.TensorReusePool  # graphs off
        clear_caches()
        r = apply_fastpath(make_tiny(recipe()), max_seqs=16, cuda_graphs=True)
        assert r.model.config.enable_cuda_graph
        fdl.build(r.model.config.transformer_layer_spec)(fdl.build(r.model.config))
        assert type(cg._CudagraphGlobalRecord.tensor_reuse_pool).__name__ == "KeepFwdInputsPool"
    finally:
        restore_cudagraph_input_recycling()
