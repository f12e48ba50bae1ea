"""Test-only launcher: the main job's GPU step path on CPU inside the CUDA-as-CPU mode, in one
process or under ``torchrun`` (gloo; Megatron's pipeline p2p over gloo). Records what the
pipeline tests compare: per-step losses and grad norms, the gradients of step 1 and the final
parameters under *global* layer names, and the cache's slot bookkeeping.

    torchrun --nproc_per_node=2 -m tests.workers.pp_worker OUT.pt parallel.pipeline_model_parallel_size=2 ...

writes ``OUT.pt.rank{r}`` per rank (``collect`` is also called in-process for PP=1).
"""

from __future__ import annotations

import os
import re
import sys

import torch

from tests.support.cuda_as_cpu import CALLS, cuda_as_cpu


def _global_names(model) -> dict:
    """Parameter name -> name with the stage's layer offset added (``decoder.layers.{i}``)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    offset = layers[0].layer_number - 1 if layers is not None and len(layers) else 0
    return {n: re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", n)
            for n, _ in model.named_parameters()}


def _load_initial(model, names, path) -> None:
    """Start from another run's initial parameters (global names): with PP each stage would
    otherwise draw its layers' weights from its own position in the RNG stream."""
    init = torch.load(path)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(init[names[n]])


def collect(overrides, save_init=None, load_init=None) -> dict:
    from tests.support.hydra_compose import compose_job

    from megatron_fastpath.train import build_job, parse_job_config, train_step

    cfg = compose_job(list(overrides))
    with cuda_as_cpu():
        job = build_job(parse_job_config(cfg))
        names = _global_names(job.model)
        if save_init:
            torch.save({names[n]: p.detach().clone() for n, p in job.model.named_parameters()},
                       save_init)
        if load_init:
            _load_initial(job.model, names, load_init)
        out = dict(losses=[], grad_norms=[], device_waits=[], max_in_flight=[], backward_checks=[], syncs=[],
                   num_slots=job.cache.config.num_slots, rank=torch.distributed.get_rank(),
                   pp_rank=_pp_rank())
        for step in range(1, job.cfg.training.steps + 1):
            batch = job.data.batch(step)
            waits = CALLS["torch.cuda.synchronize"]
            r = train_step(job, batch)
            out["device_waits"].append(CALLS["torch.cuda.synchronize"] - waits)
            out["losses"].append(float(r.loss_sum) / batch.global_loss_tokens)
            out["grad_norms"].append(None if r.grad_norm is None else float(r.grad_norm))
            out["max_in_flight"].append(job.step.in_flight.max_in_flight)
            out["backward_checks"].append(job.step.in_flight.backward_checks)
            out["syncs"].append((r.syncs_fwd_bwd, r.syncs_step))
            if step == 1:
                out["grads"] = {names[n]: p.main_grad.detach().clone()
                                for n, p in job.model.named_parameters() if p.requires_grad}
        out["params"] = {names[n]: p.detach().clone() for n, p in job.model.named_parameters()}
    return out


def _pp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_rank()


def main() -> None:
    out_path, overrides = sys.argv[1], sys.argv[2:]
    result = collect(overrides, load_init=os.environ.get("PP_WORKER_INIT"))
    torch.save(result, f"{out_path}.rank{result['rank']}")
    from megatron_fastpath.distributed import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":
    main()
