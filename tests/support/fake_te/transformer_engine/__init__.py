"""Test-only fake of Transformer Engine 2.10 (``transformer_engine``) for CPU runs.

Never on ``sys.path`` of the pytest process (Megatron computes ``HAVE_TE`` at import time and
other tests assume TE is absent): ``tests/support/fake_te/activate.py`` puts it first on
``sys.path`` in a child process (``tests/workers/te_standin_main.py``, the workers of
``tests/te_standin``). Written from TE v2.10's source (the asserts cite
``transformer_engine/...:line`` at tag v2.10); no TE code is copied. What it provides is what
Megatron-Core 0.16.1 imports unconditionally once ``import transformer_engine`` succeeds, plus
the modules of the TE GPT layer spec (Linear, LayerNormLinear, LayerNorm, RMSNorm,
DotProductAttention) with real CPU math and the FP8 recipes / autocast. Everything else is absent (an ``ImportError`` Megatron
catches) or raises ``NotImplementedError`` naming the fake.
"""

__version__ = "2.10.0"

from . import common, pytorch  # noqa: E402,F401
