"""Child process for the ``.metadata`` payload tests: ``python metadata_probe.py CASES OUT``.

CASES is a JSON list of ``[name, model_dir]``; each model_dir holds a crafted ``.metadata``.
For each, in order, ``check_safe_to_load(model_dir)`` runs under ``alarm(10)`` (the default
SIGALRM action ends the process: a payload that hangs in C code is still caught) and one JSON
line is appended to OUT *before* (``start``) and after it: the outcome, the message, the
seconds and the peak resident memory above the baseline taken before the first case. The
address space is limited to the baseline plus :data:`LIMIT_MB`, so a payload that needs more
fails with MemoryError (reported as such) instead of exhausting the machine."""

import copyreg
import json
import resource
import signal
import sys
import time

LIMIT_MB = 256
EXT_CODE = 0xF3  # the EXT1/EXT2 payloads name this code: registered, they would resolve


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def main(cases_path: str, out_path: str) -> None:
    import torch.distributed.checkpoint.filesystem  # noqa: F401 - what the checker imports on
    import torch.distributed.checkpoint.planner  # noqa: F401 - first use, before the baseline

    from megatron_fastpath.checkpoint.safety import UnsafeCheckpointError, check_safe_to_load

    copyreg.add_extension("posix", "system", EXT_CODE)
    cases = json.load(open(cases_path))
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    limit = _vm_bytes() + LIMIT_MB * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    with open(out_path, "a") as out:
        for name, model_dir in cases:
            out.write(json.dumps({"name": name, "start": True}) + "\n")
            out.flush()
            t0 = time.perf_counter()
            signal.alarm(10)
            try:
                check_safe_to_load(model_dir)
                outcome, msg = "loaded", ""
            except UnsafeCheckpointError as exc:
                outcome, msg = "refused", str(exc)
            except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails
                outcome, msg = type(exc).__name__, str(exc)[:500]
            signal.alarm(0)
            seconds = time.perf_counter() - t0
            peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
            out.write(json.dumps({"name": name, "outcome": outcome, "msg": msg,
                                  "seconds": seconds, "peak_mb": peak_mb}) + "\n")
            out.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
