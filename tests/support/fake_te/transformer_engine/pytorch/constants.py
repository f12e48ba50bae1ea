"""Fake ``transformer_engine.pytorch.constants`` (TE v2.10 ``pytorch/constants.py:87``)."""

GemmParallelModes = ("row", "column", None)
