"""A job that cannot fit is refused from its config, before anything is
built, with the estimate and the machine's memory; ``training.skip_memory_check`` overrides."""

import time

import pytest
from tests.support.hydra_compose import compose_job

from megatron_fastpath.train.config import parse_job_config
from megatron_fastpath.train.memory import GIB, check_memory, estimate_memory, parameter_count


def cfg(overrides=()):
    return compose_job(list(overrides))


def test_llama3_8b_on_this_cpu_is_refused_quickly_with_the_estimate():
    import psutil

    if psutil.virtual_memory().available > 200 * GIB:  # pragma: no cover - huge machines
        pytest.skip("this machine could hold llama3_8b's full fine-tuning state")
    from megatron_fastpath.train import preflight

    parse_job_config(cfg())  # imports warmed
    start = time.perf_counter()
    job = parse_job_config(cfg(["model=llama3_8b", "training.device=cpu"]))  # parse: no check
    with pytest.raises(ValueError) as info:
        preflight(job)  # build_job's first step, before anything is built
    assert time.perf_counter() - start < 10.0  # nothing was built (building it takes minutes)
    msg = str(info.value)
    assert "8.03B-parameter model" in msg and "available of" in msg and "GiB RAM" in msg
    for part in ("params", "grads", "optimizer", "activations"):
        assert f"{part} " in msg
    assert "training.skip_memory_check=true" in msg


def test_skip_memory_check_overrides_and_tiny_jobs_pass(monkeypatch):
    job = parse_job_config(cfg(["model=llama3_8b", "training.device=cpu", "training.skip_memory_check=true"]))
    est = estimate_memory(job)
    assert est.params_total == 8_030_261_248  # Llama-3-8B (untied embeddings)
    assert est.params == est.params_total * 4 and est.grads == est.params_total * 4
    assert est.optimizer == est.params_total * 8
    assert check_memory(parse_job_config(cfg()), available=64 * GIB).total < GIB
    check_memory(job, available=200 * GIB)  # one process: 8.03B x 16 bytes + activations fit
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"x 4 processes on this machine"):
        check_memory(job, available=200 * GIB)


def test_lora_bf16_and_model_parallel_shrink_the_estimate():
    full = estimate_memory(parse_job_config(cfg(["model=llama3_8b", "training.device=cpu",
                                                 "training.skip_memory_check=true"])))
    lora = estimate_memory(parse_job_config(cfg(["model=llama3_8b", "training.device=cpu",
                                                 "training.skip_memory_check=true", "fastpath.lora=true",
                                                 "training.dtype=bfloat16"])))
    assert lora.params == full.params // 2 and lora.grads < full.grads / 100


def test_context_parallel_shrinks_the_activations():
    common = ["model=llama3_8b", "training.device=cpu", "training.skip_memory_check=true",
              "data.max_tokens=8192", "data.max_len=1024"]
    one = estimate_memory(parse_job_config(cfg(common)))
    two = estimate_memory(parse_job_config(cfg(common + ["parallel.context_parallel_size=2"])))
    assert two.params == one.params  # CP replicates the model
    assert one.activations / 2 < two.activations < one.activations  # T / CP + the gathered K/V


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_moe"])
def test_parameter_count_equals_the_built_megatron_model(mcore_parallel, model):
    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig

    job = parse_job_config(cfg([f"model={model}", "training.device=cpu"]))
    m = job.model
    cache = PackedSeqCache(PackedSeqConfig(max_tokens=64, max_seqs=4, rope=rope_config_for(m)))
    spec = get_fastpath_layer_spec(cache, backend="sdpa", num_experts=m.num_experts)
    gpt = build_gpt_model(build_transformer_config(m), spec, m.vocab_size, 64)
    assert sum(parameter_count(m)) == sum(p.numel() for p in gpt.parameters())
