"""The optimizer settings a run gets when it leaves them unset (``null`` in
``configs/training/cpu_default.yaml``): one row per model provider and kind of fine-tune,
consulted by :func:`resolve_schedule_defaults` at parse. A value the user sets always wins.

The synthetic provider's tiny models train from random weights for a few dozen steps, hence
a high LR and a short warm-up. A Hugging Face checkpoint is fine-tuned: the rows follow the
peers' Llama 3 8B recipes --

* LoRA: ``lr 3e-4``, ``num_warmup_steps 100``, cosine to 0 (torchtune
  ``recipes/configs/llama3/8B_lora.yaml``: ``optimizer.lr: 3e-4``,
  ``lr_scheduler: get_cosine_schedule_with_warmup``, ``num_warmup_steps: 100``; its cosine
  ends at 0);
* full fine-tune: ``lr 2e-5``, ``warmup_steps 100``, cosine to 0 (Axolotl
  ``examples/llama-3/fft-8b.yaml``: ``learning_rate: 2e-5``, ``warmup_steps: 100``,
  ``lr_scheduler: cosine``; 2e-5 is also TRL's ``SFTConfig.learning_rate`` default and torchtune
  ``recipes/configs/llama3/8B_full.yaml``'s ``optimizer.lr``).

Megatron's scheduler needs the warm-up shorter than the run: a run of ``steps`` <= the warm-up
warms up over ``steps - 1`` (``step.build_scheduler``).
"""

from __future__ import annotations

import dataclasses

__all__ = ["SCHEDULE_DEFAULTS", "LR_SCHEDULES", "schedule_defaults", "resolve_schedule_defaults"]

# training.lr_schedule -> Megatron's OptimizerParamScheduler lr_decay_style (after the warm-up)
LR_SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant"}

# (model provider, LoRA) -> the unset training keys' values; a provider not listed takes
# ("synthetic", False)
SCHEDULE_DEFAULTS = {
    ("synthetic", False): dict(lr=3e-3, min_lr=3e-4, warmup_steps=4),
    ("synthetic", True): dict(lr=3e-3, min_lr=3e-4, warmup_steps=4),
    ("hf", True): dict(lr=3e-4, min_lr=0.0, warmup_steps=100),  # torchtune llama3/8B_lora.yaml
    ("hf", False): dict(lr=2e-5, min_lr=0.0, warmup_steps=100),  # Axolotl llama-3/fft-8b.yaml
}


def schedule_defaults(provider: str, lora: bool) -> dict:
    """The row of :data:`SCHEDULE_DEFAULTS` for a run of ``provider`` with / without LoRA."""
    return dict(SCHEDULE_DEFAULTS.get((provider, lora), SCHEDULE_DEFAULTS[("synthetic", lora)]))


def resolve_schedule_defaults(train, provider: str, lora: bool):
    """``train`` (a ``TrainingConfig``) with its unset (None) ``lr`` / ``min_lr`` /
    ``warmup_steps`` taken from the provider's row (an unset ``min_lr`` above a set ``lr``
    keeps the row's ratio of the two), and ``lr_schedule`` checked. Refused: a
    ``min_lr`` above the ``lr`` (the decay would raise the LR)."""
    if train.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"training.lr_schedule must be one of {', '.join(LR_SCHEDULES)}; got "
                         f"{train.lr_schedule!r}")
    row = schedule_defaults(provider, lora)
    if train.min_lr is None and train.lr is not None and train.lr < row["min_lr"]:
        row["min_lr"] = train.lr * row["min_lr"] / row["lr"]  # a lower lr set: the row's ratio
    train = dataclasses.replace(train, **{k: v for k, v in row.items() if getattr(train, k) is None})
    if train.min_lr > train.lr:
        raise ValueError(f"training.min_lr={train.min_lr:g} is above training.lr={train.lr:g}: the "
                         "schedule decays from lr to min_lr; set training.min_lr <= training.lr")
    return train
