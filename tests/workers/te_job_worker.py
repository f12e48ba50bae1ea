"""Child-process worker: the main job (``megatron_fastpath.train.run``) on the GPU path inside
the GPU stand-ins with the fake Transformer Engine importable, in one process or under
``torchrun``; writes what the tests compare to ``OUT.rank{r}``: the summary's records, how it
stopped / resumed / saved, the final model state (``state_dict`` tensors, TE's ``_extra_state``
included) and which Megatron TE classes the model holds.

    python -m tests.workers.te_job_worker OUT <overrides>
    torchrun --nproc_per_node=2 -m tests.workers.te_job_worker OUT <overrides>
"""

from tests.support.fake_te.activate import activate

activate()  # before Megatron is imported

import dataclasses  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402


def main(out: str, overrides) -> None:
    from megatron_fastpath.train import run
    from tests.support.graph_safe_standins import gpu_standins
    from tests.support.hydra_compose import compose_job
    from tests.support.matrix_runs import params

    with gpu_standins():
        summary, job = run(compose_job(list(overrides)), return_job=True)
        state = params(job)
        types = sorted({type(m).__name__ for m in job.model.modules()})
        fp8_meta = {}
        for name, m in job.model.named_modules():
            meta = vars(m).get("fp8_meta")
            if isinstance(meta, dict) and "scaling_fwd" in meta:
                s = meta["scaling_fwd"]
                fp8_meta[name] = {"recipe": type(meta["recipe"]).__name__,
                                  "scale_fwd": getattr(s, "scale", None)}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    summ = dataclasses.asdict(summary) if dataclasses.is_dataclass(summary) else dict(vars(summary))
    torch.save({"summary": summ, "state": state, "types": types, "fp8_meta": fp8_meta},
               f"{out}.rank{rank}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
