"""Megatron's DistributedOptimizer in a checkpoint: the format its sharded state is written in,
how it is asked for, and its state before the first step (checkpoint/optim.py).

``DistributedOptimizer.sharded_state_dict(model_sharded_state_dict, is_loading, sharding_type=None,
metadata=None)`` (0.16.1 optimizer/distrib_optimizer.py:1175-1295, 0.19.2 :1460-1581) writes the
parameter state (fp32 main parameters, ``exp_avg``, ``exp_avg_sq``) in the format named by
``metadata['distrib_optim_sharding_type']`` (the ``sharding_type`` argument is deprecated on
both lines, 0.16.1 :1215-1222, 0.19.2 :1500-1507), ``fully_sharded_model_space`` when absent;
``load_state_dict`` reads the format back from the state (``param_state_sharding_type``, 0.16.1
:863-881, 0.19.2 :1070-1088). The formats on both lines, and what this package does with each:

* ``fully_reshardable`` -- written: each parameter's state is one tensor of the parameter's own
  shape, keyed by the model parameter's key (``optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<key>``),
  the DP shards gathered into whole fp32 tensors in host memory on every rank at save and load
  (0.16.1 :1404-1537, ``return_on_all_ranks`` :1452; 0.19.2 :1690-1826, :1738) and sliced by each
  rank at load, so a checkpoint loads at another DP (and TP / PP) size. Megatron's own
  training writes it under ``--dist-ckpt-optim-fully-reshardable`` (training/checkpointing.py
  ``_build_sharded_state_dict_metadata``, core_v0.16.1 :422-424, core_v0.19.0 :499-502).
* ``dp_reshardable`` -- written (Megatron training's default, the same functions :426 / :505):
  each rank writes its own bucket shards, no gather (0.16.1 :1539-1687, 0.19.2 :1828-1976); the
  bucket tensors' global shape is the unpadded bucket size, so the checkpoint loads at another
  DP size with the same buckets -- the same bucket size (Megatron's DDP default
  ``max(40000000, 1000000 * dp size)`` grows with DP past 40 ranks; one bucket without
  ``overlap_grad_reduce``: distributed/distributed_data_parallel.py 0.16.1 :64-68, 0.19.2
  :68-72) -- and not at another TP / PP size (Megatron's training refuses that, core_v0.16.1
  training/checkpointing.py:1595-1601); other buckets fail the checkpoint's shape check. Its param groups (and the grad scaler's
  state) and bucket sizes are ``ShardedObject``s (0.16.1 :1247-1262 and :1578-1588, 0.19.2
  :1533-1548 and :1867-1877), which torch_dist would pickle: this package's checkpoints neither
  write nor unpickle those (checkpoint/manager.py ``_drop_objects``), so
  :func:`sharded_objects` takes them out as JSON (gathered from every rank, one per key) for
  the checkpoint's ``train_state.json`` and :func:`put_objects_back` puts them back into the
  loaded state.
* ``fully_sharded_model_space`` (the method's default) -- refused: its tensors are flattened
  slices (``flattened_range``, 0.16.1 :1748, 0.19.2 :2037) and both lines' ShardedTensor
  refuses them ("ShardedTensor.flattened_range is not supported.",
  dist_checkpointing/mapping.py:133-134 in 0.16.1 and 0.19.2).
* ``dp_zero_gather_scatter`` (deprecated, a pickled ShardedObject) and ``fsdp_dtensor`` (Megatron
  FSDP only) -- refused.

``metadata['chained_optim_avoid_prefix'] = True``, as Megatron's training passes it (core_v0.16.1
training/checkpointing.py:429, core_v0.19.0 :508): a ChainedOptimizer (dense + expert
parameters) then writes the same keys as a single optimizer (0.16.1 optimizer/optimizer.py:1194-
1198, 0.19.2 :1551-1555).

Before its first step a DistributedOptimizer over torch's Adam (no Transformer Engine / Apex,
``HAVE_APEX_OR_TE`` False: distrib_optimizer.py 0.16.1 :21-36, 0.19.2 :20-35) has no state, and
its ``state_dict`` asserts one step over that state (0.16.1 :640-643, 0.19.2 :837-840), which
``sharded_state_dict(is_loading=True)`` calls (0.16.1 :1246, 0.19.2 :1532): loading into a fresh
optimizer fails; with Transformer Engine installed and torch's Adam inside (below) the load
of the empty state fails in torch instead (Adam's ``__setstate__`` reads every state's step,
torch 2.13 optim/adam.py:127). :func:`distributed_optimizer_sharded_state` first gives a torch
optimizer without state its state through
Megatron's own ``_init_optimizer_states_with_dummy_values`` (0.16.1 :1137-1152, 0.19.2
:1422-1437; one step of zero gradients), which the load then overwrites: every tensor of the
state and the step (from the saved param groups, 0.16.1 :818-825, 0.19.2 :1025-1032).

Loading: ``DistributedOptimizer.load_state_dict`` loads the param groups (the step, for torch's
Adam into every parameter's state) and then the parameter state in its format (0.16.1
:863-881, 0.19.2 :1070-1088): ``load_parameter_state_from_dp_reshardable`` (0.16.1 :1772,
0.19.2 :2061) or, for ``fully_reshardable``,
``load_parameter_state_from_fully_reshardable`` (0.16.1 :2070-2116, 0.19.2 :2359-2405); the latter
leaves the step out of what it copies (:2100-2102 / :2389-2391) while
``_set_main_param_and_optimizer_states`` copies into every tensor of the parameter's state, the
step of torch's Adam included (0.16.1 :911-940, 0.19.2 :1193-1225): a KeyError 'step' with
torch's Adam (no Transformer Engine / Apex, and the sync-free step, which runs torch's Adam).
:func:`load_distributed_optimizer_state` runs the two halves itself: ``load_state_dict`` without
the parameter state (it then skips it, 0.16.1 :863, 0.19.2 :1070), then the format's loader with
each parameter's step set aside and put back, each its own tensor: ``load_state_dict`` gives every
parameter's state the same step tensor (0.16.1 :818-825, 0.19.2 :1025-1032), which torch's
``Optimizer.load_state_dict`` keeps as it is (torch 2.13 optim/optimizer.py:794-798), and torch's
Adam adds 1 to its step in place for each parameter it updates: one shared tensor would count a
step once per parameter.

Which branch ``state_dict`` / ``load_state_dict`` take is decided by what is installed
(``HAVE_APEX_OR_TE``, ``USING_TE_OPTIMIZER``), not by the inner optimizer: with Transformer Engine
installed and torch's Adam inside (the sync-free step swaps TE's FusedAdam for it,
compat/optim.py ``torch_adam_in_place_of_fused_adam``) the step is read from and written to the
param groups only (0.16.1 :654-666 and :672-682, 0.19.2 :851-863 and :869-879), where torch's
Adam keeps none: the per-parameter step would be lost. :func:`torch_adam_step` reads it for
the checkpoint's JSON and :func:`load_distributed_optimizer_state` gives it back to every
parameter, whichever branch ran.
"""

from __future__ import annotations

from megatron_fastpath.compat import _require_checked_mcore

__all__ = ["DEFAULT_OPTIMIZER_FORMAT", "OPTIMIZER_FORMATS", "REFUSED_OPTIMIZER_FORMATS", "check_optimizer_format", "optimizer_format_problem",
           "distributed_optimizer_leaves", "distributed_optimizer_sharded_state",
           "load_distributed_optimizer_state", "torch_adam_step", "sharded_objects", "put_objects_back"]

# the formats the package writes and reads, per checked megatron-core line
DEFAULT_OPTIMIZER_FORMAT = "dp_reshardable"  # checkpoint.optimizer_format's default, as Megatron's training
OPTIMIZER_FORMATS = {(0, 16): ("dp_reshardable", "fully_reshardable"),
                     (0, 19): ("dp_reshardable", "fully_reshardable")}
_PARAM_STATE_LOADERS = {"fully_reshardable": "load_parameter_state_from_fully_reshardable",
                        "dp_reshardable": "load_parameter_state_from_dp_reshardable"}
REFUSED_OPTIMIZER_FORMATS = {
    "fully_sharded_model_space": "megatron-core's ShardedTensor refuses its flattened tensors "
                                 "(dist_checkpointing/mapping.py: flattened_range is not supported)",
    "dp_zero_gather_scatter": "it is deprecated and stores the whole state as one pickled ShardedObject",
    "fsdp_dtensor": "it is Megatron FSDP's format, not the DistributedOptimizer's",
}


def optimizer_format_problem(fmt, version=None):
    """Why the installed megatron-core's DistributedOptimizer state cannot be written and read in
    format ``fmt`` by this package (None: it can)."""
    line = _require_checked_mcore(
        "optimizer_format_problem",
        "DistributedOptimizer.sharded_state_dict's formats (optimizer/distrib_optimizer.py)",
        version=version)
    if fmt in OPTIMIZER_FORMATS[line]:
        return None
    return REFUSED_OPTIMIZER_FORMATS.get(fmt, "megatron-core %d.%d has no such format" % line)


def check_optimizer_format(fmt, version=None) -> str:
    """``fmt`` (the ``checkpoint.optimizer_format`` setting) when :func:`optimizer_format_problem`
    finds none; else ValueError (one line: what, why, the fix)."""
    why = optimizer_format_problem(fmt, version)
    if why is None:
        return fmt
    line = _require_checked_mcore("check_optimizer_format", "as optimizer_format_problem", version=version)
    raise ValueError(f"checkpoint.optimizer_format={fmt!r} cannot be used: {why}; use "
                     f"{' or '.join(OPTIMIZER_FORMATS[line])}")


def _leaves(optimizer) -> list:
    from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer

    # a wrapper of a Megatron optimizer (the sync-free step's) keeps it as ``optimizer``
    while not isinstance(optimizer, MegatronOptimizer) and isinstance(
            getattr(optimizer, "optimizer", None), MegatronOptimizer):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


def distributed_optimizer_leaves(optimizer) -> list:
    """The DistributedOptimizers inside ``optimizer`` (a ChainedOptimizer flattened, a wrapper
    unwrapped): all its leaves, or none; a mix is refused."""
    _require_checked_mcore("distributed_optimizer_leaves", "ChainedOptimizer.chained_optimizers")
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    leaves = _leaves(optimizer)
    dist = [leaf for leaf in leaves if isinstance(leaf, DistributedOptimizer)]
    if dist and len(dist) != len(leaves):
        raise ValueError(
            f"the optimizer chains {len(dist)} DistributedOptimizer(s) with "
            f"{len(leaves) - len(dist)} other optimizer(s): a checkpoint holds one kind of "
            "optimizer state; build every chained optimizer with use_distributed_optimizer=True")
    return dist


def distributed_optimizer_sharded_state(optimizer, model_sharded_state_dict, is_loading: bool,
                                        fmt: str) -> dict:
    """``optimizer.sharded_state_dict`` of a (chain of) DistributedOptimizer(s) in format ``fmt``
    (see the module docstring); with ``is_loading``, a leaf without state gets it first."""
    check_optimizer_format(fmt)
    if is_loading:
        for leaf in distributed_optimizer_leaves(optimizer):
            if _is_torch_optimizer(leaf.optimizer) and len(leaf.optimizer.state) == 0:
                leaf._init_optimizer_states_with_dummy_values()
    metadata = {"distrib_optim_sharding_type": fmt, "chained_optim_avoid_prefix": True}
    return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)


def _is_torch_optimizer(opt) -> bool:
    return type(opt).__module__.startswith("torch.optim")


def torch_adam_step(optimizer):
    """The step count torch's Adam keeps in every parameter's state inside the
    DistributedOptimizer(s) of ``optimizer`` (None: it keeps none -- TE / Apex FusedAdam count in
    the param groups -- or has not stepped); one host read per parameter, at checkpoint time."""
    steps = {float(st["step"]) for leaf in distributed_optimizer_leaves(optimizer)
             if _is_torch_optimizer(leaf.optimizer) for st in leaf.optimizer.state.values() if "step" in st}
    if len(steps) > 1:
        raise ValueError(f"the optimizer's parameters are at different steps {sorted(steps)}")
    return int(steps.pop()) if steps else None


def load_distributed_optimizer_state(optimizer, state_dict: dict, fmt: str, adam_step=None) -> None:
    """Load ``state_dict`` (as :func:`distributed_optimizer_sharded_state` made it, loaded) into
    ``optimizer`` (see the module docstring's "Loading"); ``adam_step``: :func:`torch_adam_step`
    at save, given to every parameter of a torch Adam (None: each keeps the one the load set)."""
    import torch

    check_optimizer_format(fmt)
    leaves = distributed_optimizer_leaves(optimizer)
    # a ChainedOptimizer of several leaves keys their states by index (optimizer/optimizer.py
    # ChainedOptimizer.sharded_state_dict / load_state_dict: 0.16.1 :1204-1229, 0.19.2 :1561-1586)
    chained = len(leaves) > 1
    states = [state_dict[i] for i in range(len(leaves))] if chained else [state_dict]
    without = [{k: v for k, v in sd.items() if k != "param_state"} for sd in states]
    optimizer.load_state_dict(dict(enumerate(without)) if chained else without[0])
    for leaf, sd in zip(leaves, states):
        inner = leaf.optimizer.state
        steps = {p: st.pop("step") for p, st in inner.items() if "step" in st}
        try:
            # under no_grad: dp_reshardable's loader (0.16.1 :1772, 0.19.2 :2061) is not, unlike
            # fully_reshardable's (0.16.1 :2069, 0.19.2 :2358), and copies into main parameters
            # that are views of fp32 model parameters requiring grad (a RuntimeError otherwise)
            with torch.no_grad():
                getattr(leaf, _PARAM_STATE_LOADERS[fmt])(sd["param_state"])
        finally:
            for p, st in steps.items():
                inner[p]["step"] = st.clone()
        if adam_step is not None and _is_torch_optimizer(leaf.optimizer):
            for p in inner:  # as Megatron's load makes it (0.16.1 :821, 0.19.2 :1028), one per parameter
                inner[p]["step"] = torch.tensor(float(adam_step), dtype=torch.float32)


# -- dp_reshardable's ShardedObjects as JSON ---------------------------------------------------
def _encode(value):
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v) for k, v in value.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in value.items()]}
    raise TypeError(f"a DistributedOptimizer checkpoint object holds a {type(value).__qualname__}, "
                    "which is not saved as JSON")


def _decode(value):
    import torch

    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(_decode(v) for v in value["__tuple__"])
    if "__dtype__" in value:
        return getattr(torch, value["__dtype__"])
    if "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    if "__items__" in value:
        return {_decode(k): _decode(v) for k, v in value["__items__"]}
    return {k: _decode(v) for k, v in value.items()}


def sharded_objects(sharded_state_dict) -> dict:
    """The ShardedObjects of ``sharded_state_dict`` as JSON, ``{unique key: data}``, over every
    rank (a collective: every rank calls it; replicas share a key and hold the same data)."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    mine = {o.unique_key: _encode(o.data) for o in nested_values(sharded_state_dict)
            if isinstance(o, ShardedObject)}
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return dict(sorted(mine.items()))
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    merged = {}
    for objects in every:
        merged.update(objects)
    return dict(sorted(merged.items()))


def put_objects_back(sharded_state_dict, loaded, saved: dict) -> None:
    """Set each ShardedObject of ``sharded_state_dict`` (what was asked to load) at its place in
    ``loaded`` (what dist_checkpointing loaded without them) to its data in ``saved``
    (:func:`sharded_objects` at save); KeyError naming a missing one."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    items = sharded_state_dict.items() if isinstance(sharded_state_dict, dict) else enumerate(sharded_state_dict)
    for k, v in items:
        if isinstance(v, ShardedObject):
            if v.unique_key not in saved:
                raise KeyError(f"the checkpoint's optimizer part has no object {v.unique_key!r}")
            loaded[k] = _decode(saved[v.unique_key])
        elif isinstance(v, (dict, list)):
            put_objects_back(v, loaded[k], saved)
