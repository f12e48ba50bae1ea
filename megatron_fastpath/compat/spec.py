"""The dense-MLP entry of a TransformerLayer spec (lora/spec.py, layer_spec.py).

megatron-core 0.16.x's layer specs give ``TransformerLayerSubmodules.mlp`` as
``ModuleSpec(module=MLP, submodules=MLPSubmodules(...), params={...})`` and TransformerLayer
builds it with ``build_module(submodules.mlp, config=..., **additional_mlp_kwargs)``.

0.19.x's give a builder instead: ``functools.partial(MLP.as_mlp_submodule,
submodules=MLPSubmodules(...))`` (0.19.2 models/gpt/gpt_layer_specs.py:547-552), which
TransformerLayer calls as ``submodules.mlp(config=..., pg_collection=..., is_mtp_layer=...,
name=...)`` (transformer/transformer_layer.py:433-438); a ``ModuleSpec`` is still accepted but
re-wrapped into that call only for ``MLP`` / ``TEFusedMLP`` themselves (:420-425), so an MLP
subclass must come as ``partial(Subclass.as_mlp_submodule, ...)`` there (``as_mlp_submodule``
builds ``cls(config, submodules, tp_group, ...)``, transformer/mlp.py:389-421).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from megatron_fastpath.compat import MCORE_0_19, _require_checked_mcore

_MLP_SPEC_REASON = ("a TransformerLayer spec's dense MLP is a ModuleSpec(module=MLP, ...) on 0.16.x "
                    "and functools.partial(MLP.as_mlp_submodule, submodules=...) on 0.19.x")


def _builder_class(mlp) -> Optional[type]:
    """The MLP class of a ``partial(cls.as_mlp_submodule, ...)`` (0.19.x), else None."""
    if not isinstance(mlp, functools.partial):
        return None
    owner = getattr(mlp.func, "__self__", None)
    if isinstance(owner, type) and getattr(mlp.func, "__name__", "") == "as_mlp_submodule":
        return owner
    return None


def dense_mlp_submodules(mlp):
    """The ``MLPSubmodules`` of a layer spec's MLP entry, or None when it is not a dense MLP
    (an MoE layer's spec has no ``linear_fc1`` / ``linear_fc2`` submodules)."""
    _require_checked_mcore("dense_mlp_submodules", _MLP_SPEC_REASON)
    if _builder_class(mlp) is not None:
        subs = mlp.keywords.get("submodules")
    else:
        subs = getattr(mlp, "submodules", None)
    return subs if hasattr(subs, "linear_fc1") and hasattr(subs, "linear_fc2") else None


def dense_mlp_module(mlp):
    """The class a dense-MLP entry builds (``MLP``, a subclass, ``TEFusedMLP``)."""
    cls = _builder_class(mlp)
    return cls if cls is not None else getattr(mlp, "module", mlp)


def replace_dense_mlp(mlp, submodules=None, module: Optional[type] = None):
    """The same dense-MLP entry with other ``submodules`` and / or built as ``module`` (an
    ``MLP`` subclass taking MLP's constructor arguments), in the form the installed line's
    TransformerLayer builds (see the module docstring)."""
    line = _require_checked_mcore("replace_dense_mlp", _MLP_SPEC_REASON)
    if dense_mlp_submodules(mlp) is None:
        raise ValueError(f"not a dense MLP spec entry: {mlp!r}")
    subs = submodules if submodules is not None else dense_mlp_submodules(mlp)
    if _builder_class(mlp) is not None:
        cls = module or _builder_class(mlp)
        return functools.partial(cls.as_mlp_submodule, *mlp.args,
                                 **{**mlp.keywords, "submodules": subs})
    cls = module or mlp.module
    if line == MCORE_0_19 and module is not None:
        return functools.partial(cls.as_mlp_submodule, submodules=subs, **dict(mlp.params))
    return dataclasses.replace(mlp, module=cls, submodules=subs)
