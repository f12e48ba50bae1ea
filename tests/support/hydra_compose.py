"""The main job's config tree composed by Hydra from the package's own config directory (what
``python -m megatron_fastpath.train <overrides>`` parses), for tests that parse or run it in
process."""

from hydra import compose, initialize_config_dir

from megatron_fastpath.train import config_dir


def compose_job(overrides=()):
    """The composed tree (an OmegaConf DictConfig) for ``overrides``."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))
