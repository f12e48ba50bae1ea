"""The synthetic pair: a Llama-style model of the ``model`` group's shape, randomly initialised,
and synthetic SFT samples (``data.SyntheticSFTDataset``) packed into microbatches. The main
job's default (the embedded CPU run of the README)."""

from __future__ import annotations

from megatron_fastpath.providers import (
    DataParts,
    DataProvider,
    ModelProvider,
    ModelSource,
    register_data_provider,
    register_model_provider,
)

__all__ = ["SyntheticData", "SyntheticModel"]


class SyntheticModel(ModelProvider):
    key = "synthetic"

    def settings(self) -> type:
        from megatron_fastpath.model import ModelConfig

        return ModelConfig

    def parse(self, group: dict, tp: int, ep: int) -> ModelSource:
        from megatron_fastpath.model import ModelConfig, rope_config_for
        from megatron_fastpath.settings import parse_group

        config = parse_group("model", ModelConfig, group)
        return ModelSource(self.key, config, rope_config_for(config))


class SyntheticData(DataProvider):
    key = "synthetic"

    def settings(self) -> type:
        from megatron_fastpath.data import DataConfig

        return DataConfig

    def parse(self, group: dict, model: ModelSource):
        from megatron_fastpath.data import DataConfig
        from megatron_fastpath.settings import parse_group

        held_out = sorted(k for k in group if k.startswith("eval_"))
        if held_out:  # data=jsonl's held-out settings (evaluation, samples)
            raise ValueError(
                f"data.{held_out[0]} is a setting of data=jsonl: synthetic data has no held-out "
                "split and no text (no tokenizer to decode samples with), so there is nothing to "
                "evaluate or sample; use model=hf model.path=<dir> data=jsonl data.path=<file>, "
                f"or drop {', '.join('data.' + k for k in held_out)}")
        return parse_group("data", DataConfig, group)

    def build(self, cfg, dp_rank: int, dp_world: int) -> DataParts:
        """Synthetic SFT samples packed into microbatches; refuses too few for one step."""
        from megatron_fastpath.data import SyntheticSFTDataset, train_step_data

        train = train_step_data(SyntheticSFTDataset(cfg.data, cfg.model.vocab_size), cfg,
                                dp_rank, dp_world)
        if len(train.bins) < train.per_step:
            lower = f" or lower {train.batch_key}" if train.batch_size is not None else ""
            raise ValueError(f"only {len(train.bins)} packed microbatches for {train.per_step} per "
                             f"step; raise data.num_samples{lower}")
        return DataParts(train)


register_model_provider(SyntheticModel())
register_data_provider(SyntheticData())
