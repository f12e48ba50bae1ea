"""The main job's command-line overrides checked before Hydra composes them, so that a key the
config does not have is one ``error: ...`` line with the fix (Hydra's own message suggests
appending it with ``+key=value``, which the parse would then refuse as an unknown key):

* a key another option of its group has (``data.path`` while ``data=synthetic_sft`` is chosen):
  "add data=jsonl";
* otherwise the config's closest keys (:func:`difflib.get_close_matches` over every key of the
  composed tree): ``training.step=3`` -> "did you mean training.steps".

Only plain ``key=value`` overrides of the job's own groups are read; ``+key`` / ``~key``, the
``hydra.*`` keys and any command-line flag leave the composition to Hydra.
"""

from __future__ import annotations

import difflib
import os
from typing import Optional, Sequence

__all__ = ["check_overrides", "compose_tree", "did_you_mean", "unknown_key_error"]


def _leaf_keys(node, prefix: str = "") -> list:
    """Every dotted key of a plain (container) tree."""
    out = []
    for k, v in node.items():
        key = f"{prefix}{k}"
        out += _leaf_keys(v, key + ".") if isinstance(v, dict) and v else [key]
    return out


def _options_with_key(configs: str, group: str, key: str) -> list:
    """The options of ``group`` (its YAML files under ``configs``) whose top level has ``key``."""
    import yaml

    where = os.path.join(configs, group)
    found = []
    for name in sorted(os.listdir(where)) if os.path.isdir(where) else ():
        if not name.endswith(".yaml"):
            continue
        with open(os.path.join(where, name)) as f:
            body = yaml.safe_load(f) or {}
        if isinstance(body, dict) and key in body:
            found.append(name[: -len(".yaml")])
    return found


def did_you_mean(word: str, candidates) -> str:
    """"did you mean X?" (and the next closest) for the ``candidates`` closest to ``word``
    (:func:`difflib.get_close_matches`); "" when none is close."""
    close = difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.6)
    if not close:
        return ""
    return f"did you mean {close[0]}?" + (f" (or {', '.join(close[1:])})" if close[1:] else "")


def unknown_key_error(key: str, tree: dict, choices: dict, configs: str) -> Optional[str]:
    """The message for override ``key`` when the composed ``tree`` (a plain dict; ``choices``:
    each group's chosen option) lacks it; None when it has it."""
    keys = _leaf_keys(tree)
    group, _, rest = key.partition(".")
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            break
        node = node[part]
    else:
        return None
    if group in choices and rest and "." not in rest:
        others = [o for o in _options_with_key(configs, group, rest) if o != choices[group]]
        if others:
            pick = " or ".join(f"{group}={o}" for o in others)
            fix = f"add {pick}" if len(others) == 1 else f"add one of {pick}"
            return (f"{key} is a setting of {pick}, not of {group}={choices[group]} (the {group} "
                    f"option chosen): {fix}")
    close = did_you_mean(key, keys)
    if close:
        return f"{key} is not a setting of the job config: {close}"
    if group in tree and isinstance(tree[group], dict):
        return (f"{key} is not a setting of the job config: the {group} group's keys are "
                f"{', '.join(sorted(tree[group]))}")
    return (f"{key} is not a setting of the job config: its groups are "
            f"{', '.join(sorted(k for k in tree if k != 'hydra'))}")


def _plain_key(override: str) -> Optional[str]:
    """The dotted key of a plain ``key=value`` override (None for a group choice, an append /
    delete, a hydra.* key or anything else)."""
    key, eq, _ = override.partition("=")
    if not eq or key[:1] in "+~" or "." not in key or key.startswith("hydra.") or "@" in key:
        return None
    return key


def check_overrides(overrides: Sequence[str], configs: Optional[str] = None) -> None:
    """Raise ValueError (one line: what, why, the fix) for the first plain override whose key
    the composed config lacks. Anything not a plain ``key=value`` (a flag) leaves all of it to
    Hydra; a composition that fails on the group choices alone is Hydra's to report."""
    from megatron_fastpath.train.config import config_dir

    if any(o.startswith("-") for o in overrides):
        return
    keys = [k for k in map(_plain_key, overrides) if k]
    if not keys:
        return
    from hydra.core.global_hydra import GlobalHydra

    configs = configs or config_dir()
    groups = [o for o in overrides if "=" in o and _plain_key(o) is None
              and not o.startswith(("+", "~", "hydra."))]
    if GlobalHydra.instance().is_initialized():
        return
    try:
        tree, choices = compose_tree(groups, configs)
    except Exception:  # noqa: BLE001 - a bad group choice: Hydra's own message says which
        return
    for key in keys:
        message = unknown_key_error(key, tree, choices, configs)
        if message:
            raise ValueError(message)


def compose_tree(overrides: Sequence[str], configs: str) -> tuple[dict, dict]:
    """(the composed config as a plain dict less ``hydra``, {group: its chosen option}) of
    ``overrides`` (Hydra's compose; its exception when they do not compose)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=os.path.abspath(configs), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    choices = {k: v for k, v in OmegaConf.to_container(cfg.hydra.runtime.choices).items()
               if isinstance(v, str) and not k.startswith("hydra")}
    tree = OmegaConf.to_container(cfg, resolve=False)
    tree.pop("hydra", None)
    return tree, choices
