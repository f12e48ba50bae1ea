"""``data.eval_samples``: the held-out prompts the model completes at each evaluation, their
stop tokens and the tokenizer's decoding."""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from megatron_fastpath.hf.data.config import JsonlDataConfig
from megatron_fastpath.hf.data.splits import JsonlDataset

__all__ = ["eval_prompts", "stop_token_ids", "build_eval_prompts"]


def _checkpoint_eos_ids(model_dir: Optional[str]) -> set:
    """``eos_token_id`` (an id or a list) of the checkpoint's generation_config.json, else of
    its config.json: where transformers' ``generate`` reads its stop tokens."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name) if model_dir else None
        if not path or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return {int(e) for e in (eos if isinstance(eos, list) else [eos])}
    return set()


def stop_token_ids(tokenizer, model_dir: Optional[str] = None) -> frozenset:
    """The tokens a sampled completion stops at: the tokenizer's EOS (the end-of-turn token of
    a chat tokenizer, e.g. <|eot_id|>) and the checkpoint's ``eos_token_id``(s)."""
    ids = _checkpoint_eos_ids(model_dir)
    if tokenizer.eos_id is not None:
        ids.add(tokenizer.eos_id)
    return frozenset(ids)


def eval_prompts(held: JsonlDataset, n: int) -> tuple:
    """(prompt ids, reference ids) of the first ``n`` held-out records (record order): the
    prompt is every token before the first loss token (a chat record: what the template renders
    before the assistant reply, generation prompt included; prompt / completion: the prompt),
    the reference the reply's tokens up to the end of that first trained span."""
    out = []
    for tok, loss in held.samples[:n]:
        trained = np.flatnonzero(loss[:-1] > 0)  # loss[j]: position j predicts token j + 1
        if not len(trained):  # pragma: no cover - refused when tokenized (no_loss_token)
            continue
        start = int(trained[0]) + 1
        end = start
        while end < len(tok) and loss[end - 1] > 0:
            end += 1
        out.append((tuple(int(t) for t in tok[:start]), tuple(int(t) for t in tok[start:end])))
    return tuple(out)


def build_eval_prompts(cfg: JsonlDataConfig, held: Optional[JsonlDataset], tokenizer_path: str,
                       model_dir: Optional[str] = None):
    """The ``providers.EvalPrompts`` of ``data.eval_samples`` (None when it is 0 or nothing is
    held out): the first held-out prompts, the stop tokens, and the tokenizer's decoding."""
    if not cfg.eval_samples or held is None:
        return None
    from megatron_fastpath.hf.tokenizer import ChatTokenizer
    from megatron_fastpath.providers import EvalPrompts

    tok = ChatTokenizer(cfg.tokenizer_path or tokenizer_path)
    return EvalPrompts(
        prompts=eval_prompts(held, cfg.eval_samples),
        stop_ids=stop_token_ids(tok, model_dir),
        max_new_tokens=cfg.eval_max_new_tokens,
        decode=lambda ids: tok.tokenizer.decode(ids, skip_special_tokens=False),
        decode_reply=lambda ids: tok.tokenizer.decode(ids, skip_special_tokens=True))
