"""Child-process worker: the main job (``megatron_fastpath.train.run``) on the GPU path inside
the GPU stand-ins with the fake Transformer Engine importable, in one process or under
``torchrun``; writes what the tests compare to ``OUT.rank{r}``: the summary's records, how it
stopped / resumed / saved, the final model state (``state_dict`` tensors, TE's ``_extra_state``
included) and which Megatron TE classes the model holds.

    python -m tests.te_standin.job_worker OUT <overrides>
    torchrun --nproc_per_node=2 -m tests.te_standin.job_worker OUT <overrides>
"""

from tests.support.fake_te.activate import activate

activate()  # before Megatron is imported

import dataclasses  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402


def _unpickled_extra_state(key: str, blob: torch.Tensor) -> dict:
    """TE's pickled ``_extra_state`` as comparable tensors (the pickle's bytes are not stable
    across processes; its content is): ``key/<name>`` per tensor, ``key/recipe`` its repr."""
    import pickle

    content = pickle.loads(blob.detach().cpu().numpy().tobytes())
    out = {f"{key}/{name}": t for name, t in content.items() if torch.is_tensor(t)}
    text = repr((content["recipe"], sorted(content["extra_fp8_variables"].items())))
    out[f"{key}/recipe"] = torch.tensor(list(text.encode()), dtype=torch.uint8)
    return out


def main(out: str, overrides) -> None:
    from megatron_fastpath.train import run
    from tests.support.graph_safe_standins import gpu_standins
    from tests.support.hydra_compose import compose_job

    with gpu_standins():
        summary, job = run(compose_job(list(overrides)), return_job=True)
        state = {}
        for k, v in job.model.state_dict().items():
            if k.endswith("_extra_state") and torch.is_tensor(v) and v.numel():
                state.update(_unpickled_extra_state(k, v))
            elif torch.is_tensor(v):
                state[k] = v.detach().clone()
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
