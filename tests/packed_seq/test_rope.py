"""RoPE settings and math (packed_seq/rope.py) against Megatron's RotaryEmbedding, and Llama 3.1
scaling as one validated value."""

import dataclasses
import math

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_fastpath.packed_seq import Llama3RopeScaling, RopeConfig


@pytest.mark.parametrize("scaling", [
    Llama3RopeScaling(8.0),
    Llama3RopeScaling(32.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position=4096),
])
def test_llama3_scaling_is_megatrons_apply_scaling_with_all_four_values(scaling):
    """Megatron's GPTModel passes only the factor; its _apply_scaling takes all four (NeMo and
    Bridge set them from Llama31Config): every one reaches the frequencies."""
    megatron = RotaryEmbedding(kv_channels=128, rotary_percent=1.0, rotary_base=500000,
                               use_cpu_initialization=True)
    ref = megatron._apply_scaling(
        megatron.inv_freq, factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position)
    ours = RopeConfig(dim=128, base=500000.0, llama3=scaling).inv_freq()
    assert torch.equal(ours, ref)
    for change in (dict(factor=4.0), dict(low_freq_factor=1.5), dict(high_freq_factor=16.0),
                   dict(original_max_position=1024)):  # each value changes the result
        other = RopeConfig(dim=128, base=500000.0, llama3=dataclasses.replace(scaling, **change))
        assert not torch.equal(other.inv_freq(), ours), change


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("interpolation", [None, 2.0])
def test_angles_are_megatrons_rotary_embedding_per_position(interleaved, interpolation):
    """The cache's per-token angles at positions 0..S-1 are Megatron's RotaryEmbedding rows
    (get_emb without the device move: halves concatenated or pairs interleaved)."""
    megatron = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_interleaved=interleaved,
                               seq_len_interpolation_factor=interpolation, rotary_base=10000,
                               rope_scaling=True, rope_scaling_factor=8.0,
                               use_cpu_initialization=True)
    freqs_SF = megatron.get_freqs_non_repeated(40)
    if interleaved:
        ref_SD = torch.stack((freqs_SF.view(-1, 1), freqs_SF.view(-1, 1)), dim=-1).view(40, -1)
    else:
        ref_SD = torch.cat((freqs_SF, freqs_SF), dim=-1)
    rope = RopeConfig(dim=16, interleaved=interleaved, seq_len_interpolation_factor=interpolation,
                      llama3=Llama3RopeScaling(8.0))
    assert torch.equal(rope.angles_TD(torch.arange(40, dtype=torch.int32), rope.inv_freq()), ref_SD)


@pytest.mark.parametrize("kwargs, match", [
    (dict(factor=0.0), r"Llama3RopeScaling.factor is 0.0: .* must be a finite number > 0; Llama 3.1 uses factor=8.0"),
    (dict(factor=float("nan")), r"Llama3RopeScaling.factor is nan: .* finite number > 0"),
    (dict(factor=True), r"Llama3RopeScaling.factor is True"),
    (dict(factor="8"), r"Llama3RopeScaling.factor is '8'"),
    (dict(factor=8.0, low_freq_factor=-1.0), r"Llama3RopeScaling.low_freq_factor is -1.0"),
    (dict(factor=8.0, high_freq_factor=math.inf), r"Llama3RopeScaling.high_freq_factor is inf"),
    (dict(factor=8.0, low_freq_factor=4.0),
     r"low_freq_factor=4.0 is not below high_freq_factor=4.0: .*interpolated.*use low < high"),
    (dict(factor=8.0, original_max_position=0),
     r"original_max_position is 0: .* whole number >= 1; Llama 3.1 uses 8192"),
    (dict(factor=8.0, original_max_position=8192.5), r"original_max_position is 8192.5"),
])
def test_llama3_scaling_refuses_bad_values_saying_what_why_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Llama3RopeScaling(**kwargs)


def test_llama3_scaling_normalises_its_types():
    s = Llama3RopeScaling(8, low_freq_factor=1, high_freq_factor=4, original_max_position=8192)
    assert s == Llama3RopeScaling(8.0)
    assert [type(v) for v in dataclasses.astuple(s)] == [float, float, float, int]


def test_rope_config_takes_the_scaling_as_one_value():
    with pytest.raises(TypeError, match=r"RopeConfig.llama3 is 8.0: it must be a Llama3RopeScaling or None"):
        RopeConfig(dim=8, llama3=8.0)
    with pytest.raises(ValueError, match="even"):
        RopeConfig(dim=7)
