"""One training step of a Llama-style model on a GPU: stock Megatron-Core vs the fast path.

    python benchmarks/gpu_step.py [--layers 8] [--tokens 8192] [--reps 5] [--json out.json]

Sides, all in this process, one after another on the same packed data (the main job's synthetic
SFT bins: ``data.max_tokens`` tokens per microbatch, sequences of ``--min-len``..``--max-len``),
the same Llama-3-8B-shaped layers (``model=llama3_8b`` with ``--layers`` of its 32; hidden 4096,
GQA 32 / 8, SwiGLU 14336, vocab 128256), bf16, all weights trained (megatron-core has no LoRA:
Megatron-Bridge's PEFT adds it; the LoRA + graph paths are the check's main-job items):

``megatron``
    Megatron-Core's own layer spec and ``GPTModel.forward`` with its own optimizer step (reads
    the grad norm and found-inf to the host): with Transformer Engine, its TE spec on THD
    ``PackedSeqParams`` (``cu_seqlens`` built on the host per microbatch and copied, as a packed
    dataset hands them); without TE, its local spec, whose attention takes no
    ``PackedSeqParams``, on the same sequences padded to rows ([B, S_max], causal mask).
``ours``
    the main job's step (:func:`megatron_fastpath.train.train_step`): the packed-sequence cache
    read by every layer, the sync-free optimizer step, no graphs.
``ours_layer_graphs``
    the same with per-layer CUDA graphs (Megatron's CudaGraphManager, captured in step 1).
``ours_full_iteration``
    the same with the step as two graphs (captured at step 2).

Per side: the minimum over ``--reps`` timed steps (after the warm-up steps a side needs: graphs
capture) of the step's device time (CUDA events); tokens/s/GPU (real tokens, padding not
counted); model TFLOP/s and MFU against ``--peak-tflops`` (the H100 / H200 SXM datasheet's dense
bf16 figure; the model FLOPs count causal attention as half the square, see :func:`model_flops`);
host syncs in one counted step (``SyncSentinel``); peak memory allocated; graph launches per
step. ``ours`` and ``megatron`` start from the same weights: their first-step losses are compared.
On a machine without CUDA it says so and exits 3 (``--device cpu`` runs the ``ours`` side only,
for the tests).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_meter import LoadMeter  # noqa: E402

NO_CUDA_EXIT = 3
H200_BF16_DENSE_TFLOPS = 989.0  # H100 / H200 SXM datasheet, dense (no sparsity)


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    groups: int
    ffn: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def gemm_flops(shape: Shape, tokens: int) -> float:
    """Forward FLOPs of the GEMMs over ``tokens``: every layer's QKV (GQA), output projection
    and SwiGLU MLP, and the output layer, 2 per multiply-add."""
    h, kv = shape.hidden, shape.groups * shape.head_dim
    per_token = shape.layers * (h * (h + 2 * kv) + h * h + 3 * h * shape.ffn) + h * shape.vocab
    return 2.0 * tokens * per_token


def attention_flops(shape: Shape, lengths: list) -> float:
    """Forward FLOPs of causal attention over packed sequences: scores and their product with V
    as half of each sequence's square (2 x 2 x n^2 / 2 x heads x head_dim per layer)."""
    return shape.layers * 2.0 * sum(n * n for n in lengths) * shape.heads * shape.head_dim


def model_flops(shape: Shape, lengths: list, train: bool = True) -> float:
    """Model FLOPs of one step over packed sequences of ``lengths`` (real tokens only, padding
    not counted): :func:`gemm_flops` + :func:`attention_flops`, x3 with ``train`` (the backward
    is twice the forward)."""
    fwd = gemm_flops(shape, sum(lengths)) + attention_flops(shape, lengths)
    return fwd * (3 if train else 1)


def overrides(args, feature: list) -> list:
    return [f"model={args.model}", f"model.num_layers={args.layers}", "data=synthetic_sft",
            f"data.max_tokens={args.tokens}", f"data.max_seqs={args.max_seqs}",
            f"data.min_len={args.min_len}", f"data.max_len={args.max_len}",
            f"data.num_samples={args.samples}", f"training.steps={args.steps}",
            f"training.micro_batches={args.micro_batches}", "training.dtype=bfloat16",
            f"training.device={args.device}", "training.sync_check=off", "metrics.tensorboard=false",
            "metrics.wandb=off", "metrics.plot=false",
            "training.skip_memory_check=true", "hydra.run.dir=.", *feature]


def build(args, feature: list):
    from hydra import compose, initialize_config_dir

    from megatron_fastpath.train import build_job, config_dir, parse_job_config

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[o for o in overrides(args, feature)
                                                       if not o.startswith("hydra.")])
    return build_job(parse_job_config(cfg))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_ours(args, name: str, feature: list, warmup: int) -> dict:
    """The main job's step: ``warmup`` steps, then ``--reps`` timed ones, one of them counted."""
    from megatron_fastpath.sync import SyncSentinel
    from megatron_fastpath.train import train_step

    # one process group and Megatron parallel state serve every side (init_distributed reuses them)
    job = build(args, feature)
    device = job.cfg.device
    times, first_loss, syncs, launches = [], None, None, None
    for step in range(1, warmup + args.reps + 1):
        batch = job.data.batch(step)
        if step == warmup + 1 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        counted = step == warmup + args.reps  # the last step, inside the sentinel
        _sync(device)
        t0 = time.perf_counter()
        with SyncSentinel() if counted else contextlib.nullcontext() as sentinel:
            res = train_step(job, batch, check_syncs=False)
        _sync(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
        if counted:
            syncs = sentinel.num_syncs
        if step == 1:
            first_loss = float(res.loss_sum) / res.loss_tokens
        if step > warmup and not counted:
            times.append(res.device_timing[0].elapsed_time(res.device_timing[1])
                         if res.device_timing is not None else wall_ms)
            launches = res.graph_launches
    lengths = [list(map(int, mb.lengths)) for mb in job.data.batch(warmup + 1).microbatches]
    row = _row(name, times, lengths, args, device)
    row.update(first_loss=first_loss, host_syncs_per_step=syncs, graph_launches_per_step=launches)
    return row, job


def _row(name, times, lengths, args, device) -> dict:
    shape = _shape(args)
    flat = [n for mb in lengths for n in mb]
    best_ms = min(times) if times else None
    flops = model_flops(shape, flat)
    row = {"side": name, "step_ms_min": round(best_ms, 2) if best_ms else None,
           "step_ms_all": [round(t, 2) for t in times], "tokens": sum(flat),
           "sequences": len(flat), "model_flop_per_step": flops}
    if best_ms:
        row["tokens_per_s"] = round(sum(flat) / (best_ms / 1e3), 1)
        row["model_tflops"] = round(flops / (best_ms / 1e3) / 1e12, 1)
        row["mfu"] = round(row["model_tflops"] / args.peak_tflops, 4)
    if device.type == "cuda":
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row


def _shape(args) -> Shape:
    from omegaconf import OmegaConf

    from megatron_fastpath.train import config_dir

    m = OmegaConf.load(Path(config_dir()) / "model" / f"{args.model}.yaml")
    return Shape(args.layers, m.hidden_size, m.num_attention_heads, m.num_query_groups or
                 m.num_attention_heads, m.ffn_hidden_size, m.vocab_size)


def measure_megatron(args, ours_job, ours_state: dict) -> dict:
    """Stock Megatron-Core on the ``ours`` job's data and weights (see the module docstring)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_fastpath._optional import have
    from megatron_fastpath.model import build_gpt_model
    from megatron_fastpath.sync import SyncSentinel
    from megatron_fastpath.train.step import megatron_ddp_and_optimizer

    from megatron_fastpath.train.job import _init_distributed, build_transformer

    cfg = ours_job.cfg
    _init_distributed(cfg)
    thd = have("transformer_engine.pytorch")
    tcfg = build_transformer(cfg)
    spec = get_gpt_layer_with_transformer_engine_spec() if thd else get_gpt_layer_local_spec(
        normalization="RMSNorm")
    model = build_gpt_model(tcfg, spec, cfg.model.vocab_size, cfg.data.max_tokens)
    res = model.load_state_dict(ours_state, strict=False)
    if res.unexpected_keys:
        raise RuntimeError(f"the fast path's weights do not map onto Megatron's spec: {res}")
    model.to(cfg.device)
    ddp, optimizer = megatron_ddp_and_optimizer(
        model, tcfg, dataclasses.replace(cfg.training, optimizer_step="megatron"))
    device = cfg.device
    times, first_loss, syncs = [], None, None
    try:
        for step in range(1, 1 + args.reps + 1):
            batch = ours_job.data.batch(step)
            counted = step == 1 + args.reps
            _sync(device)
            t0 = time.perf_counter()
            with SyncSentinel() if counted else contextlib.nullcontext() as sentinel:
                loss = _megatron_step(ddp, optimizer, batch, device, thd)
            _sync(device)
            dt = (time.perf_counter() - t0) * 1e3
            if counted:
                syncs = sentinel.num_syncs
            if step == 1:
                first_loss = float(loss)
                torch.cuda.reset_peak_memory_stats()
            elif not counted:
                times.append(dt)
        lengths = [list(map(int, mb.lengths)) for mb in ours_job.data.batch(2).microbatches]
        row = _row("megatron", times, lengths, args, device)
        row.update(first_loss=first_loss, host_syncs_per_step=syncs, graph_launches_per_step=0,
                   attention="TE spec, THD PackedSeqParams" if thd else
                   "local spec, rows padded to the longest sequence (no THD without TE)")
        return row
    finally:
        del ddp, optimizer, model


def _megatron_step(ddp, optimizer, batch, device, thd: bool) -> torch.Tensor:
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    total = torch.zeros((), device=device)
    for mb in batch.microbatches:
        lengths = [int(n) for n in mb.lengths]
        loss = (_thd_loss if thd else _padded_loss)(ddp, mb, lengths, device)
        (loss / batch.global_loss_tokens).backward()
        total += loss.detach()
    ddp.finish_grad_sync()
    optimizer.step()
    return total / batch.global_loss_tokens


def _thd_loss(model, mb, lengths, device):
    from megatron.core.packed_seq_params import PackedSeqParams

    n = sum(lengths)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    cu = cu.to(device)
    pos = torch.cat([torch.arange(k) for k in lengths])[None].to(device)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    tok = mb.tokens_1T[:, :n].to(device)
    lab = mb.labels_1T[:, :n].to(device)
    per_token = model(input_ids=tok, position_ids=pos, attention_mask=None, labels=lab,
                      packed_seq_params=psp)
    return (per_token.float() * mb.loss_mask_1T[:, :n].to(device)).sum()


def _padded_loss(model, mb, lengths, device):
    b, s = len(lengths), max(lengths)
    tok = torch.zeros(b, s, dtype=torch.long)
    lab = torch.zeros(b, s, dtype=torch.long)
    mask = torch.zeros(b, s)
    start = 0
    for i, k in enumerate(lengths):
        tok[i, :k] = mb.tokens_1T[0, start:start + k]
        lab[i, :k] = mb.labels_1T[0, start:start + k]
        mask[i, :k] = mb.loss_mask_1T[0, start:start + k]
        start += k
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
    pos = torch.arange(s, device=device)[None].expand(b, s)
    per_token = model(input_ids=tok.to(device), position_ids=pos, attention_mask=causal,
                      labels=lab.to(device))
    return (per_token.float() * mask.to(device)).sum()


SIDES = (  # (name, overrides, warm-up steps before the timed ones, needs CUDA)
    ("ours", [], 1, False),
    ("ours_layer_graphs", ["fastpath.cuda_graphs=true", "cuda_graphs.use_te_rng_tracker=false"], 2, True),
    ("ours_full_iteration", ["fastpath.cuda_graphs=true", "cuda_graphs.scope=full_iteration",
                             "cuda_graphs.use_te_rng_tracker=false"], 3, True),
)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3_8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192, help="packed tokens per microbatch")
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.steps = 3 + args.reps + 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step: no CUDA device on this machine: nothing was run (--device cpu runs the "
              "'ours' side on the CPU)", file=sys.stderr)
        sys.exit(NO_CUDA_EXIT)
    with LoadMeter() as meter:  # the sides measured, with the load around them
        results, skipped = [], {}
        first_job = first_state = None
        for name, feature, warmup, needs_cuda in SIDES:
            if needs_cuda and args.device != "cuda":
                skipped[name] = "needs CUDA (graphs capture on a GPU only)"
                continue
            row, job = measure_ours(args, name, feature, warmup)
            results.append(row)
            print(f"gpu_step: {name}: {row.get('step_ms_min')} ms, {row.get('tokens_per_s')} tok/s, "
                  f"MFU {row.get('mfu')}, syncs {row['host_syncs_per_step']}", flush=True)
            if first_job is None:
                first_job = job
                first_state = {k: v.detach().cpu() for k, v in job.model.state_dict().items()
                               if "_extra_state" not in k}
            del job
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        if args.device == "cuda":
            try:
                row = measure_megatron(args, first_job, first_state)
                results.insert(0, row)
                print(f"gpu_step: megatron: {row.get('step_ms_min')} ms, {row.get('tokens_per_s')} "
                      f"tok/s, syncs {row['host_syncs_per_step']}", flush=True)
            except Exception as exc:  # reported beside ours: the stock side's own failure
                skipped["megatron"] = f"failed: {type(exc).__name__}: {str(exc)[:400]}"
        else:
            skipped["megatron"] = "needs CUDA (megatron-core 0.16.1's GPTModel RoPE runs on CUDA)"
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__, "shape": dataclasses.asdict(_shape(args)),
           "peak_tflops": args.peak_tflops, "results": results, "skipped": skipped,
           "load": meter.report()}
    by = {r["side"]: r for r in results}
    if "megatron" in by and "ours" in by and by["megatron"]["first_loss"]:
        out["first_loss_rel_diff"] = abs(by["ours"]["first_loss"] - by["megatron"]["first_loss"]) / abs(
            by["megatron"]["first_loss"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
