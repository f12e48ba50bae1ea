"""``python -m megatron_fastpath.train --help [<group> ...] [<overrides>]``: every key of the
composed config, per group, with its value as composed for the overrides (``--help model=hf``
shows model=hf's keys) and its one-line description; group names after ``--help`` print those
groups only.

The descriptions are not kept here: each key's is the ``help`` of the dataclass field that
reads it (``settings.setting``) -- the groups' types of :func:`~megatron_fastpath.train.config.group_types`,
the model / data providers' ``settings()`` -- plus the ``provider`` key's
(``providers.provider_key_help``) and the moved keys' (``train/config.py`` ``_MOVED_KEYS``).
Nothing here builds or touches a device: Hydra composes, the types are read.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

__all__ = ["HELP_FLAGS", "describe_group", "job_help", "wants_help"]

HELP_FLAGS = ("--help", "-h")
# Hydra's flags followed by a value (hydra-core 1.3.8 hydra/_internal/utils.py:501-595, get_args_parser)
_HYDRA_VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name",
                      "-cn", "--config-dir", "-cd", "--info", "-i", "--experimental-rerun")

_USAGE = """\
python -m megatron_fastpath.train [<group>=<option> ...] [<group>.<key>=<value> ...]

Each key below: <group>.<key>=<value> as composed for the overrides given, then what it sets."""

_FOOTER = """\
--help <group> [<group> ...]: those groups only (with overrides: as they compose, e.g.
  --help model=hf model); --cfg job: the composed config as YAML (Hydra; -p <group>: one group);
  --hydra-help: Hydra's own flags. Keys set to ??? must be given; null ones are resolved at parse
  (training.dry_run=true prints the resolved plan). docs/configuration.md describes the groups."""


def wants_help(argv: Sequence[str]) -> bool:
    """Whether the command line asks for this help (``--help`` / ``-h``)."""
    return any(a in HELP_FLAGS for a in argv)


def _options(configs: str, group: str) -> list:
    where = os.path.join(configs, group)
    return sorted(n[: -len(".yaml")] for n in os.listdir(where) if n.endswith(".yaml")) \
        if os.path.isdir(where) else []


def describe_group(group: str, node: dict) -> dict:
    """{key: its one-line description} for the composed ``group`` (``node``: its keys; model /
    data: those of the provider it names). A key with no description maps to ""."""
    from megatron_fastpath.providers import data_provider, model_provider, provider_key_help
    from megatron_fastpath.settings import describe
    from megatron_fastpath.train.config import _MOVED_KEYS, group_types

    if group in ("model", "data"):
        lookup = model_provider if group == "model" else data_provider
        out = describe(lookup(node.get("provider") or "synthetic").settings())
        out["provider"] = provider_key_help(group)
    else:
        types = group_types()
        out = describe(types[group]) if group in types else {}
    for old, new in _MOVED_KEYS:
        old_group, key = old.split(".")
        if old_group == group:
            out[key] = f"moved to {new}: setting it is refused (use {new}=<dir>)"
    return {key: out.get(key, "") for key in node}


def _value(v) -> str:
    """A composed value as it is written on the command line / in the YAML."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(_value, v)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def job_help(args: Sequence[str], configs: Optional[str] = None) -> str:
    """The help text for ``args``, the command line less the help flag: group names (the groups
    to print; none: all) and overrides (``key=value``, composed as the job would). Raises
    ValueError (one line) for an unknown group or key, or overrides that do not compose."""
    from megatron_fastpath.train.config import config_dir
    from megatron_fastpath.train.overrides import check_overrides, compose_tree, did_you_mean

    configs = configs or config_dir()
    # Hydra's own flags (and the value of those that take one) are left out
    words = [a for i, a in enumerate(args) if not a.startswith("-")
             and not (i and args[i - 1] in _HYDRA_VALUE_FLAGS)]
    overrides = [a for a in words if "=" in a]
    asked = [a for a in words if "=" not in a]
    check_overrides(overrides, configs)  # an unknown key: "did you mean"
    try:
        tree, choices = compose_tree(overrides, configs)
    except Exception as exc:  # noqa: BLE001 - a bad group choice or value: Hydra's message says which
        raise ValueError("; ".join(line.strip() for line in str(exc).splitlines() if line.strip())) from None
    for name in asked:
        if name not in tree:
            hint = did_you_mean(name, tree) or f"the groups are {', '.join(tree)}"
            raise ValueError(f"--help {name}: no config group {name!r}; {hint}")
    lines = [_USAGE]
    for group in asked or tree:
        node = tree[group]
        options = _options(configs, group)
        chosen = f"{group}={choices[group]}" if group in choices else "fixed"
        lines.append(f"\n{group} ({chosen}; options: {', '.join(options) or 'none'})")
        for key, text in describe_group(group, node).items():
            lines.append(f"  {group}.{key}={_value(node[key])}")
            lines.append(f"      {text or '(no description)'}")
    lines.append("\n" + _FOOTER)
    return "\n".join(lines)
