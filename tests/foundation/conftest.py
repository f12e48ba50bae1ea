"""Model builders shared by the foundation tests: our packed spec and an independent unpacked
reference (Megatron's own RoPE function + plain causal SDPA, one sequence at a time)."""

import pytest
import torch

from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
from packed_reference import TINY, reference_layer_spec

@pytest.fixture
def build_pair(mcore_parallel):
    """(packed_model, reference_model, cache) with identical weights."""

    def build(model_cfg=TINY, max_tokens=32, max_seqs=8, num_slots=1, backend="sdpa",
              dtype=torch.float32):
        from megatron_fastpath.layer_spec import get_fastpath_layer_spec

        cfg = build_transformer_config(model_cfg, params_dtype=dtype)
        rope = rope_config_for(model_cfg)
        cache = PackedSeqCache(PackedSeqConfig(max_tokens=max_tokens, max_seqs=max_seqs,
                                               num_slots=num_slots, rope=rope))
        torch.manual_seed(0)
        packed = build_gpt_model(cfg, get_fastpath_layer_spec(cache, backend=backend),
                                 model_cfg.vocab_size, max_tokens)
        ref = build_gpt_model(cfg, reference_layer_spec(rope), model_cfg.vocab_size, max_tokens)
        missing = ref.load_state_dict(packed.state_dict(), strict=False)
        assert not missing.unexpected_keys and all("_extra_state" in k for k in missing.missing_keys)
        return packed, ref, cache

    return build
