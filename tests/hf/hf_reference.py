"""Tiny random Hugging Face checkpoints (built locally with transformers, fp32, GQA, 2 layers)
and helpers to run our packed model next to the transformers model."""

from __future__ import annotations

import os

import torch

FAMILIES = ("llama", "llama3_tied", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe",
            "qwen3_moe_norm")
MOE = ("mixtral", "qwen3_moe", "qwen3_moe_norm")
VOCAB = 96
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "examples", "data", "arith_chat.jsonl")  # shipped chat data
# the packed batch the parity tests run: five sequences in MAX_TOKENS
LENGTHS = [13, 7, 20, 9, 1]
MAX_TOKENS = 64
REL_TOL = 1e-4
PHI3_ORIGINAL = 32  # phi3_longrope's original_max_position_embeddings (>= LENGTHS, < MAX_TOKENS)
# gemma2's caps and window, low / short enough that they bite on the tiny model
GEMMA2 = dict(attn_logit_softcapping=1.5, final_logit_softcapping=2.0, sliding_window=8,
              query_pre_attn_scalar=24)


def hf_config(family: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=48, rms_norm_eps=1e-5,
                  max_position_embeddings=256, rope_theta=1000.0, tie_word_embeddings=False)
    if family == "llama":  # Llama 3.1: llama3 rope scaling (small original context so it bites)
        return tf.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if family == "llama3_tied":  # Llama 3.2: tied embeddings
        return tf.LlamaConfig(**{**common, "tie_word_embeddings": True})
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=None, head_dim=16)
    if family == "mistral_window":  # Mistral 7B v0.1's sliding window, as long as LENGTHS' longest
        return tf.MistralConfig(**common, sliding_window=max(LENGTHS), head_dim=16)
    if family == "qwen2":
        return tf.Qwen2Config(**common, use_sliding_window=False)
    if family == "qwen2_yarn":  # Qwen2.5 long context: yarn (small original context so it bites)
        return tf.Qwen2Config(**common, use_sliding_window=False, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    if family == "llama_yarn":  # yarn with every optional key (mscale ratio, betas, no truncation)
        return tf.LlamaConfig(**common, rope_scaling={
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
            "beta_fast": 8.0, "beta_slow": 0.5, "mscale": 1.0, "mscale_all_dim": 0.5,
            "truncate": False})
    if family == "qwen3":  # head_dim != hidden / heads, QK-norm
        return tf.Qwen3Config(**common, head_dim=24, use_sliding_window=False)
    if family.startswith("phi3"):  # fused qkv_proj / gate_up_proj (Phi3Config's pad id 32000: 0 here)
        phi = dict(common, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if family == "phi3":
            return tf.Phi3Config(**phi)
        if family == "phi3_partial":  # Phi-4-mini's partial rotary dim, Phi-3-mini's sliding window
            return tf.Phi3Config(**phi, partial_rotary_factor=0.5, sliding_window=max(LENGTHS))
        if family == "phi3_longrope":  # Phi-3 128k: longrope (small original context so it bites)
            gen = torch.Generator().manual_seed(7)
            return tf.Phi3Config(**phi, original_max_position_embeddings=PHI3_ORIGINAL, rope_scaling={
                "type": "longrope",
                "short_factor": (1.0 + 3.0 * torch.rand(8, generator=gen)).tolist(),
                "long_factor": (4.0 + 20.0 * torch.rand(8, generator=gen)).tolist()})
    if family == "gemma2":  # tied (Gemma's default), alternating windows from layer 0
        return tf.Gemma2Config(**{**common, "tie_word_embeddings": True}, head_dim=16, **GEMMA2)
    if family == "gemma2_nocap":  # the same model without either cap
        return tf.Gemma2Config(**{**common, "tie_word_embeddings": True}, head_dim=16, **{
            **GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    if family in ("gemma3", "gemma3_linear"):  # q / k norms, a second RoPE base on sliding layers
        extra = {"rope_scaling": {"rope_type": "linear", "factor": 4.0}} if family == "gemma3_linear" else {}
        return tf.Gemma3TextConfig(**{**common, "tie_word_embeddings": True}, head_dim=16,
                                   query_pre_attn_scalar=24, sliding_window=8,
                                   sliding_window_pattern=2, rope_local_base_freq=50.0, **extra)
    moe = dict(common, intermediate_size=32, num_experts_per_tok=2)
    if family == "mixtral":
        return tf.MixtralConfig(**moe, num_local_experts=4, sliding_window=None)
    if family in ("qwen3_moe", "qwen3_moe_norm"):
        return tf.Qwen3MoeConfig(**moe, num_experts=4, moe_intermediate_size=32, head_dim=16,
                                 norm_topk_prob=family == "qwen3_moe_norm", decoder_sparse_step=1,
                                 mlp_only_layers=[], use_sliding_window=False)
    raise KeyError(family)


@torch.no_grad()
def randomize(model, seed: int = 0) -> None:
    """Weights large enough that a layout error changes the logits; norms around 1."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)


def make_checkpoint(family: str, path: str, shard: bool = False, seed: int = 0):
    """Save a tiny random model of ``family`` to ``path``; returns the transformers model."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager")
    randomize(model, seed)
    model.eval()
    model.save_pretrained(path, safe_serialization=True,
                          max_shard_size="60KB" if shard else "10GB")
    return model


def packed_tokens(lengths, max_tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    tokens = torch.zeros(1, max_tokens, dtype=torch.long)
    tokens[0, :total] = torch.randint(0, VOCAB, (total,), generator=gen)
    return tokens


# --- our model next to the transformers model ---------------------------------------------
def build_ours(path, lora=None, max_tokens=MAX_TOKENS, max_seqlen=None):
    from megatron_fastpath.hf.config import read_hf_config
    from megatron_fastpath.hf.model import load_hf_model
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    spec = read_hf_config(path)
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=max_tokens, max_seqs=8, max_seqlen=max_seqlen,
                                           rope=spec.rope_config(),
                                           rope_local=spec.rope_config_local()))
    model, _, spec = load_hf_model(path, cache, lora=lora, show_progress=False)
    return model, cache, spec


def packed_logits(model, cache, tokens, lengths=LENGTHS):
    with cache.batch(lengths) as pb:
        return model(tokens, pb.position_ids_1T, None, packed_seq_params=pb.packed_seq_params)


def assert_rel_close(ours, ref, tol=REL_TOL, what=""):
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= tol, f"{what}: relative error {rel:.2e} > {tol:.0e}"
    return rel


def per_sequence(tokens, lengths=LENGTHS):
    start = 0
    for n in lengths:
        yield start, tokens[:, start : start + n]
        start += n


def assert_packed_logits_equal(model, cache, ref, what=""):
    """Our packed logits of the :data:`LENGTHS` sequences (one packed batch of
    :data:`MAX_TOKENS`) equal the transformers model ``ref``'s on each sequence alone."""
    import torch

    tokens = packed_tokens(LENGTHS, MAX_TOKENS)
    with torch.no_grad():
        ours = packed_logits(model.eval(), cache, tokens)
        for start, seq in per_sequence(tokens):
            assert_rel_close(ours[:, start : start + seq.shape[1]], ref(seq).logits,
                             what=f"{what} @{start}")


def lora_targets(family):
    return ("linear_qkv", "linear_proj") if family in MOE else (
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def held_out_loss(model, records, with_accuracy=False):
    """transformers' held-out loss (and share of loss tokens whose argmax is the label)."""
    total, correct, tokens = 0.0, 0, 0
    with torch.no_grad():
        for ids, loss_mask in records:
            logits = model(input_ids=torch.as_tensor(ids)[None]).logits[0, :-1]
            labels, mask = torch.as_tensor(ids[1:]), torch.as_tensor(loss_mask[:-1])
            ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
            total += float((ce * mask).sum())
            correct += int(((logits.argmax(-1) == labels) * mask.bool()).sum())
            tokens += int(loss_mask.sum())
    return (total / tokens, correct / tokens) if with_accuracy else total / tokens


# --- export round trip (tests/hf/test_hf_export.py, test_hf_window_yarn.py) -------------------
def train_a_few_steps(model, cache, steps=3):
    from megatron_fastpath.lora import freeze_base_parameters

    freeze_base_parameters(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    tokens = packed_tokens(LENGTHS, MAX_TOKENS, seed=3)
    labels = torch.roll(tokens, -1, 1)
    for _ in range(steps):
        with cache.batch(LENGTHS) as pb:
            loss = model(tokens, pb.position_ids_1T, None, labels=labels,
                         packed_seq_params=pb.packed_seq_params)[:, : sum(LENGTHS)].sum()
            loss.backward()
        opt.step()
        opt.zero_grad()


def check_export_round_trip(tmp_path, family, max_seqlen=None):
    """Import ``family``'s tiny checkpoint, train LoRA a few steps, export both ways: PEFT loads
    the adapter with no missing / unexpected keys and gives our logits; the merged checkpoint
    loaded by AutoModelForCausalLM gives them too (tmp_path: base/, adapter/, merged/;
    max_seqlen: the cache's sequence bound)."""
    import json

    import transformers as tf
    from peft import PeftModel

    from megatron_fastpath.hf.export import save_merged_checkpoint, save_peft_adapter
    from megatron_fastpath.lora import LoRAConfig

    src = str(tmp_path / "base")
    make_checkpoint(family, src)
    with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 256}, f)  # a tokenizer file that must be copied
    cfg = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, targets=lora_targets(family))
    model, cache, spec = build_ours(src, lora=cfg, max_seqlen=max_seqlen)
    train_a_few_steps(model, cache)
    model.eval()
    tokens = packed_tokens(LENGTHS, MAX_TOKENS, seed=9)
    with torch.no_grad():
        ours = packed_logits(model, cache, tokens)

    adapter_dir = str(tmp_path / "adapter")
    save_peft_adapter(model, spec, cfg, adapter_dir)
    base = tf.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
    pm = PeftModel.from_pretrained(base, adapter_dir)
    # load again explicitly to read peft's key report
    result = pm.load_adapter(adapter_dir, adapter_name="check")
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]
    pm.set_adapter("default")
    merged_dir = str(tmp_path / "merged")
    save_merged_checkpoint(model, spec, merged_dir)
    assert os.path.isfile(os.path.join(merged_dir, "tokenizer_config.json"))
    merged = tf.AutoModelForCausalLM.from_pretrained(merged_dir, attn_implementation="eager")
    base_only = tf.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
    with torch.no_grad():
        for start, seq in per_sequence(tokens):
            mine = ours[:, start : start + seq.shape[1]]
            assert_rel_close(mine, pm(input_ids=seq).logits, what="peft")
            assert_rel_close(mine, merged(input_ids=seq).logits, what="merged")
            # the adapter was trained: the base alone differs
            assert ((mine - base_only(input_ids=seq).logits).abs().max() > 1e-3)


# --- peft LoRA next to ours ------------------------------------------------------------
def make_peft(ref, spec, ours, cfg):
    """peft LoRA on a copy of the transformers model with our adapter weights (via our export)."""
    import copy

    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    from megatron_fastpath.hf.export import PEFT_MODULES, peft_state_dict

    modules = sorted({m for t in cfg.targets for m in PEFT_MODULES[t]})
    pm = get_peft_model(copy.deepcopy(ref), LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, target_modules=modules))
    result = set_peft_model_state_dict(pm, peft_state_dict(ours, spec))
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]
    return pm


def randomize_adapters(model, seed=5):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B") or n.endswith("lora_A"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def peft_grads_as_ours(pm, spec, i, target):
    """Gradient of our fused adapter from peft's per-module gradients (A shared by the parts)."""
    from megatron_fastpath.hf.convert import fuse_qkv
    from megatron_fastpath.hf.export import PEFT_MODULES

    layer = pm.base_model.model.model.layers[i]
    owner = layer.self_attn if target in ("linear_qkv", "linear_proj") else layer.mlp
    mods = [getattr(owner, name) for name in PEFT_MODULES[target]]
    gA = sum(m.lora_A["default"].weight.grad for m in mods)
    gBs = [m.lora_B["default"].weight.grad for m in mods]
    if target == "linear_qkv":
        gB = fuse_qkv(*gBs, spec.num_query_groups)
    else:
        gB = torch.cat(gBs, 0)
    return gA, gB
