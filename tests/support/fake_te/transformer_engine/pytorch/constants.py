"""Fake ``transformer_engine.pytorch.constants`` (TE v2.10 ``pytorch/constants.py:87``)."""

GemmParallelModes = ("row", "column", None)

# constants.py:43-55 (TE v2.10)
AttnMaskTypes = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
                 "padding_causal_bottom_right", "arbitrary")
AttnTypes = ("self", "cross")
AttnBiasTypes = ("pre_scale_bias", "post_scale_bias", "no_bias", "alibi")
