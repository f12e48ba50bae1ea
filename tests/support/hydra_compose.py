"""The main job's config tree composed by Hydra from the package's own config directory (what
``python -m megatron_fastpath.train <overrides>`` parses), for tests that parse or run it in
process."""

from hydra import compose, initialize_config_dir

from megatron_fastpath.train import config_dir


def compose_job(overrides=()):
    """The composed tree (an OmegaConf DictConfig) for ``overrides``."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def features_on(overrides):
    """``overrides`` less the settings of each feature group (lora, offload, cuda_graphs, fp8)
    whose ``fastpath`` switch they do not turn on: for a shared list of what a feature needs
    when it is on (the parse refuses a group's settings while its switch is off:
    ``settings.settings_while_off``)."""
    from megatron_fastpath.settings import FEATURE_SWITCHES

    on = {g for g, switch in FEATURE_SWITCHES.items() if f"{switch}=true" in overrides}
    return [o for o in overrides
            if not (o.split(".")[0] in FEATURE_SWITCHES and o.split(".")[0] not in on and "=" in o)]
