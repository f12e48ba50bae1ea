"""A small training loop (fastpath GPT + fused AdamW + Megatron's LR scheduler) for the
checkpoint tests, independent of the main job."""

import torch

from megatron_fastpath.lora import LoRAConfig, freeze_base_parameters
from tests.support.tiny_gpt import SHAPE, T, build_tiny_gpt  # noqa: F401  (SHAPE: re-exported to the tests)

LENGTHS = [9, 1, 14, 8]
STEPS = 6


class Run:
    def __init__(self, lora=None, seed=0, shape=SHAPE):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.shape = shape
        self.model, self.cache = build_tiny_gpt(lora, seed, shape)
        if lora is not None:
            freeze_base_parameters(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), fused=True)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
            lr_decay_steps=STEPS, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
            wd_incr_steps=STEPS, wd_incr_style="constant",
        )
        self.step = 0
        self.losses = []

    def batch(self, step):
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, self.shape.vocab_size, (1, T), generator=g)
        return tokens, torch.roll(tokens, -1, 1)

    def train(self, n):
        self.model.train()
        for _ in range(n):
            self.step += 1
            tokens, labels = self.batch(self.step)
            with self.cache.batch(LENGTHS) as pb:
                per_token = self.model(tokens, pb.position_ids_1T, None, labels=labels,
                                       packed_seq_params=pb.packed_seq_params)
            loss = per_token[:, : sum(LENGTHS)].mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step(increment=1)
            self.losses.append(loss.item())
        return self

    def params(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items() if torch.is_tensor(v)}

    def parts(self, adapters_only=False, **extra):
        """The run's checkpoint parts: model, optimizer, scheduler, its losses and ``extra``
        ({name: part})."""
        from megatron_fastpath.checkpoint import training_parts

        return {**training_parts(self.model, self.optimizer, self.scheduler, adapters_only),
                "losses": Losses(self), **extra}

    def manager(self, directory, adapters_only=False, **kw):
        from megatron_fastpath.checkpoint import CheckpointConfig, CheckpointManager

        kw.setdefault("async_save", False)
        cfg = CheckpointConfig(dir=str(directory), adapters_only=adapters_only, **kw)
        mgr = CheckpointManager(cfg, {"shape": str(self.shape)}, log=lambda s: None)
        return mgr, self.parts(adapters_only)

    def save(self, directory, **kw):
        mgr, parts = self.manager(directory, **kw)
        return mgr.save(self.step, parts)

    def load(self, directory, **kw):
        mgr, parts = self.manager(directory, **kw)
        resumed = mgr.load(parts)
        if resumed is not None:
            self.step = resumed.step
        return resumed


class Losses:
    """The run's per-step losses as a checkpoint part."""

    def __init__(self, run):
        self.run = run

    def state_dict(self) -> dict:
        return {"losses": list(self.run.losses)}

    def load_state_dict(self, state: dict) -> None:
        self.run.losses = list(state["losses"])


class JsonPart:
    """A part of given JSON state (what it loads replaces it)."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


LORA = LoRAConfig(rank=4, alpha=8, dropout=0.1)
