"""LoRA on a sequence-parallel base (MLPerf Llama-2-70B LoRA runs TP = 4 with sequence
parallelism): the tiny LoRA GPT at TP = 2 with ``sequence_parallel=True`` equals the same model
without it -- per-token losses bit-identical, every gradient equal once Megatron's own
``finalize_model_grads`` reduction has summed the ``sequence_parallel``-marked ones over TP --
and the job refuses the layouts it cannot run, before any device work."""

import os
import subprocess
import sys

import pytest
import torch

from tests.support.cuda_as_cpu import cuda_as_cpu
from tests.support.subproc import child_env, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _expected_sequence_parallel_params(num_layers=2) -> set:
    """Weights that see one sequence shard: the norms, A of the column linears (qkv, fc1),
    B of the row linears (proj, fc2)."""
    names = {"decoder.final_layernorm.weight"}
    for i in range(num_layers):
        p = f"decoder.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight",
                  p + "self_attention.linear_qkv.lora_A", p + "mlp.linear_fc1.lora_A",
                  p + "self_attention.linear_proj.lora_B", p + "mlp.linear_fc2.lora_B"}
    return names


@pytest.mark.integration
def test_tp2_sequence_parallel_lora_equals_tp2_without(tmp_path):
    out = str(tmp_path / "sp.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", "-m", "tests.workers.lora_sp_worker", out]
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for r in (0, 1):
        res = torch.load(f"{out}.rank{r}")
        assert torch.equal(res["out_sp"], res["out"])  # per-token losses [1, T], full sequence
        marked = set(res["sp_marked"])
        assert marked == _expected_sequence_parallel_params()
        for n, ref in res["grads"].items():
            assert ref.abs().sum() > 0, n  # lora_B drawn non-zero: every weight has a gradient
            torch.testing.assert_close(res["grads_sp"][n], ref, atol=1e-6, rtol=1e-6, msg=n)
            local = res["grads_sp_local"][n]
            if n in marked:  # this rank's shard only: the reduction is what makes it whole
                assert not torch.allclose(local, ref, atol=1e-4), n
            else:  # TP-sharded or fed the full sequence: whole on each rank already
                assert torch.equal(local, ref), n


def _parse(overrides):
    from tests.support.hydra_compose import compose_job

    from megatron_fastpath.train import parse_job_config

    cfg = compose_job(["training.skip_memory_check=true", *overrides])
    return parse_job_config(cfg)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["parallel.sequence_parallel=true"], "needs parallel.tensor_model_parallel_size >= 2"),
        (["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
         "parallel.sequence_parallel needs CUDA"),
    ],
)
def test_sequence_parallel_refused_on_cpu(overrides, match):
    with pytest.raises(ValueError, match=match):
        _parse(["training.device=cpu", *overrides])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model=tiny_moe"], "an MoE model with parallel.tensor_model_parallel_size=2"),
        # an odd data.max_tokens: samples counted unpadded (data.pad_multiple divides it)
        (["data.max_tokens=129", "data.max_len=48", "data.pad_multiple=1"],
         r"max_tokens=129 tokens over the 2 TP ranks"),
        ([], r"needs Transformer Engine's norms and linears \(fastpath.linear_impl=te\)"),
    ],
)
def test_sequence_parallel_layouts_refused_on_the_gpu_path(overrides, match):
    sp = ["training.device=cuda", "parallel.tensor_model_parallel_size=2",
          "parallel.sequence_parallel=true"]
    with cuda_as_cpu():
        with pytest.raises(ValueError, match=match):
            _parse(sp + overrides)
        job = _parse(sp[:2] + [o for o in overrides if o.startswith("data.")])
        assert not job.parallel.sequence_parallel  # the same job without it parses
