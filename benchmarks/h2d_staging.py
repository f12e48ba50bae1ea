"""Host->device copies of each microbatch's token ids, labels and loss mask.

Before: ``mb.tokens_1T.to(device, non_blocking=True)`` (and labels, loss mask) straight from
the dataset's pageable bins -- on CUDA each such copy first synchronises the stream (CUDA
Runtime API, *API synchronization behavior*), so the host waits for the GPU to drain three
times per microbatch. Ours: :class:`megatron_fastpath.packed_seq.staging.PinnedStaging` -- a
host memcpy into a pinned ring buffer, then two non-blocking copies.

On CUDA both sides run in one process with the GPU kept busy (``torch.cuda._sleep`` queued
before each microbatch, as a forward would be) and report host time per step (what the
training loop waits before it can issue the next work) and the counts: pageable copies (each a
stream sync), pinned copies, bytes. On a CPU there is no host->device copy at all: the row
reports the memcpy into the staging ring that the GPU path adds (measured with pageable
buffers: pinning needs CUDA), and the counts the step makes on CUDA by construction are left
out (``null``), not guessed.

    python benchmarks/h2d_staging.py --json benchmarks/results/h2d_staging.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_meter import LoadMeter, describe, publish  # noqa: E402

from megatron_fastpath.data import PackedMicrobatch  # noqa: E402
from megatron_fastpath.packed_seq.staging import PinnedStaging  # noqa: E402


def _bins(t: int, n: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tok = torch.randint(0, 32000, (1, t), generator=g)
        out.append(PackedMicrobatch(tokens_1T=tok, labels_1T=torch.roll(tok, -1, 1),
                                    loss_mask_1T=torch.ones(1, t), lengths=None, num_loss_tokens=t))
    return out


def _cuda_row(t: int, n: int, reps: int, busy_cycles: int) -> dict:
    dev = torch.device("cuda")
    mbs = _bins(t, n)
    staging = PinnedStaging(t, dev, num_buffers=3)

    def pageable():
        for mb in mbs:
            torch.cuda._sleep(busy_cycles)  # the previous microbatch's work, still running
            mb.tokens_1T.to(dev, non_blocking=True), mb.labels_1T.to(dev, non_blocking=True)
            mb.loss_mask_1T.to(dev, non_blocking=True)

    def staged():
        for mb in mbs:
            torch.cuda._sleep(busy_cycles)
            staging.to_device(mb)

    best = {}
    for name, fn in (("pageable", pageable), ("staged", staged)):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)  # host time to issue the step's copies
            torch.cuda.synchronize()
        best[name] = min(times)
    before = staging.stats.copies
    staged()
    torch.cuda.synchronize()
    return dict(tokens=t, microbatches=n, device=torch.cuda.get_device_name(),
                pageable_copies_per_step={"before": 3 * n, "ours": 0},
                pinned_copies_per_step={"before": 0, "ours": 2 * (staging.stats.copies - before)},
                bytes_per_step=staging.stats.bytes // max(staging.stats.copies, 1) * n,
                host_ms_before=round(best["pageable"] * 1e3, 3), host_ms_ours=round(best["staged"] * 1e3, 3),
                before_over_ours=round(best["pageable"] / best["staged"], 2))


def _cpu_row(t: int, n: int, reps: int) -> dict:
    mbs = _bins(t, n)
    ids_2T, mask_T = torch.empty(2, t, dtype=torch.int64), torch.empty(t)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for mb in mbs:
            ids_2T[0].copy_(mb.tokens_1T[0]), ids_2T[1].copy_(mb.labels_1T[0])
            mask_T.copy_(mb.loss_mask_1T[0])
        times.append(time.perf_counter() - t0)
    return dict(tokens=t, microbatches=n, device="cpu (no host->device copy exists)",
                pageable_copies_per_step=None, pinned_copies_per_step=None,
                bytes_per_step=n * (2 * t * 8 + t * 4),
                staging_memcpy_ms_per_step=round(min(times) * 1e3, 4))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20, help="repeats per side (minimum taken)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--busy-cycles", type=int, default=2_000_000, help="GPU sleep queued per microbatch")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    with LoadMeter() as meter:
        rows = [(_cuda_row(t, args.microbatches, args.reps, args.busy_cycles) if cuda
                 else _cpu_row(t, args.microbatches, args.reps)) for t in (4096, 16384)]
    env = dict(torch=torch.__version__, **meter.report())
    keys = [k for k in rows[0] if k != "device"]
    text = "\n".join(
        [f"device: {rows[0]['device']}", "  ".join(keys)]
        + ["  ".join(str(r[k]) for k in keys) for r in rows]
        + ["", ("ratio: before_over_ours = host time to issue a step's copies from pageable bins / "
                "through the pinned staging ring (> 1: ours waits less)") if cuda else
           ("CPU: only the staging memcpy the GPU path adds is measured; the pageable copies it "
            "removes (3 per microbatch, each a stream sync on CUDA) need a GPU to time"),
           describe(env)])
    return publish(args, env, rows, text)


if __name__ == "__main__":
    main()
