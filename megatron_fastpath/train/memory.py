"""Will the job fit? Parameter, gradient, optimizer and activation memory estimated from the
config alone, checked against the machine's memory before anything is built.

``model=llama3_8b`` on a CPU machine otherwise builds for a minute and dies in the allocator.
The estimate is per process and deliberately simple (it is a refusal threshold, not a
profiler): parameters exactly as Megatron's Llama-style ``GPTModel`` has them (embedding and
untied output layer, attention with GQA, SwiGLU MLP or experts, RMSNorm weights), sharded by
TP x PP (experts also by EP); gradients and AdamW state (two fp32 moments, plus an fp32 master
copy for bf16) for the trainable parameters only (LoRA adapters when ``fastpath.lora``); the
activations one packed microbatch of T tokens keeps for backward (per layer and token: about
10 hidden-sized and 4 MLP-sized tensors, plus the fp32 logits and their gradient).

With Megatron's ``DistributedOptimizer`` (ZeRO-1) the optimizer state -- the two fp32 Adam
moments and, for bf16, the fp32 main-parameter copy -- is sharded over the data-parallel ranks
(DP x CP for dense parameters, expert data parallel DP x CP / EP for experts); the model
parameters and the gradient buffer stay whole on each rank. What that rests on, in
megatron-core 0.16.1 | 0.19.2 (``megatron/core/``):

* ``distributed/distributed_data_parallel.py:291-301 | :220-224``: the dense parameters' buffers
  are built over ``intra_dp_cp_group``, the experts' over ``intra_expt_dp_group``;
* ``distributed/param_and_grad_buffer.py:796-808 | :1174-1187``: each buffer's ``grad_data``
  (fp32: the main job's ``grad_reduce_in_fp32``) holds every parameter of the buffer on every
  rank, and ``param_data`` replaces the parameters' own storage (``:822-835 | :1298-1303``: the
  old tensor is copied in and freed), so the parameters are not held twice;
* ``distributed/param_and_grad_buffer.py:435-449 | :704-718``: the gradient reduce-scatter
  writes each rank's shard into a view of ``grad_data``; ``:277-290 | :507-520``: the parameter
  all-gather writes into ``bucket.param_data`` from a view of it -- neither allocates a
  bucket, so overlapping them adds nothing here;
* ``optimizer/distrib_optimizer.py:368, 399 | :412, 445``: a bf16 parameter's fp32 main copy is
  ``clone().float()`` of its shard (the ``gbuf_size // data_parallel_world_size`` range,
  ``:193 | :231``); an fp32 parameter's main parameter is a view of its shard (``:421 | :467``),
  no copy; ``:441-444 | :487-490``: the Adam parameter groups hold the shards only, so
  ``exp_avg`` / ``exp_avg_sq`` are allocated per shard. The buffers' alignment padding (a
  bucket to a multiple of lcm(DP, 128) elements) is left out.

Key: T tokens per microbatch, H hidden size, F MLP size, V vocabulary, L layers, E experts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

__all__ = ["MemoryEstimate", "check_memory", "estimate_memory", "launched_data_parallel_size",
           "machine_memory", "parameter_count"]

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process of each part; ``params_total`` is the whole model's parameter count.
    ``optimizer_shards``: the ranks the optimizer state is sharded over, (dense, experts);
    (1, 1) without the distributed optimizer."""

    params_total: int
    params: int
    grads: int
    optimizer: int
    activations: int
    optimizer_shards: tuple[int, int] = (1, 1)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def describe(self) -> str:
        parts = ", ".join(f"{k} {getattr(self, k) / GIB:.1f} GiB{self._sharding(k)}"
                          for k in ("params", "grads", "optimizer", "activations"))
        return f"{self.total / GIB:.1f} GiB ({parts})"

    def _sharding(self, part: str) -> str:
        dense, experts = self.optimizer_shards
        if part != "optimizer" or (dense, experts) == (1, 1):
            return ""
        tail = f", experts over {experts}" if experts != dense else ""
        return f" sharded over {dense} data-parallel ranks{tail}"


def parameter_count(model) -> tuple[int, int]:
    """``(dense, expert)`` parameters of a ``ModelConfig``'s Megatron GPTModel (untied output)."""
    h, layers = model.hidden_size, model.num_layers
    kv = model.kv_channels or h // model.num_attention_heads
    attn = h * kv * (model.num_attention_heads + 2 * model.num_query_groups)  # linear_qkv
    attn += model.num_attention_heads * kv * h  # linear_proj
    norms = 2 * h + (2 * kv if model.qk_layernorm else 0)
    if model.num_experts is None:
        mlp, experts = 3 * h * model.ffn_hidden_size, 0  # SwiGLU fc1 (2F x H) + fc2 (H x F)
    else:
        ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
        mlp, experts = model.num_experts * h, model.num_experts * 3 * h * ffn  # router, experts
    dense = layers * (attn + norms + mlp) + 2 * model.vocab_size * h + h  # + final norm
    return dense, layers * experts


def _lora_parameters(model, lora) -> int:
    h = model.hidden_size
    kv = model.kv_channels or h // model.num_attention_heads
    shapes = {
        "linear_qkv": (h, kv * (model.num_attention_heads + 2 * model.num_query_groups)),
        "linear_proj": (model.num_attention_heads * kv, h),
        "linear_fc1": (h, 2 * model.ffn_hidden_size),
        "linear_fc2": (model.ffn_hidden_size, h),
    }
    return model.num_layers * sum(lora.rank * sum(shapes[t]) for t in lora.targets)


def launched_data_parallel_size(parallel) -> int:
    """Data-parallel ranks of the launcher's world (WORLD_SIZE / SLURM_NTASKS; 1 unset) for a
    ``ParallelConfig``: the world over TP x PP x CP."""
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    return max(world // (parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
                         * parallel.context_parallel_size), 1)


def estimate_memory(cfg, data_parallel_size: int = 1, distributed_optimizer: bool = False) -> MemoryEstimate:
    """The per-process estimate for a parsed ``JobConfig`` at ``data_parallel_size`` ranks of data
    parallelism (the world over TP x PP x CP); ``distributed_optimizer``: the optimizer state is
    sharded over DP x CP (experts: DP x CP / EP), as Megatron's DistributedOptimizer shards it."""
    if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be a positive int; got {data_parallel_size!r}")
    model, par = cfg.model, cfg.parallel
    dense, experts = parameter_count(model)
    mp = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
    local_dense, local_experts = dense // mp, experts // (mp * par.expert_model_parallel_size)
    width = 2 if cfg.training.dtype == "bfloat16" else 4
    # trainable (dense, experts): LoRA's adapters sit on the dense linears
    trainable = ((_lora_parameters(model, cfg.lora) // mp, 0) if cfg.lora is not None
                 else (local_dense, local_experts))
    optimizer_per = 8 + (4 if width == 2 else 0)  # AdamW moments (+ fp32 master copy)
    cp = par.context_parallel_size
    shards = (1, 1)
    if distributed_optimizer:  # intra_dp_cp_group; intra_expt_dp_group (expert TP = TP)
        shards = (data_parallel_size * cp, max(data_parallel_size * cp // par.expert_model_parallel_size, 1))
    optimizer = sum(-(-n // k) for n, k in zip(trainable, shards)) * optimizer_per  # a shard each
    tokens = cfg.data.max_tokens // cp  # a CP rank holds T / CP tokens of every packed batch
    mlp = (model.ffn_hidden_size if model.num_experts is None
           else model.moe_router_topk * (model.moe_ffn_hidden_size or model.ffn_hidden_size))
    layers_here = model.num_layers // par.pipeline_model_parallel_size
    acts = tokens * layers_here * width * (10 * model.hidden_size + 4 * mlp) // par.tensor_model_parallel_size
    acts += tokens * model.vocab_size * 4 * 2 // par.tensor_model_parallel_size  # fp32 logits + grad
    if cp > 1:  # the K/V all-gathered over CP (all T tokens, saved per layer) and the [T/CP, T] mask
        acts += (cfg.data.max_tokens * layers_here * width * 2 * model.hidden_size
                 // par.tensor_model_parallel_size)
        acts += tokens * cfg.data.max_tokens * width
    return MemoryEstimate(params_total=dense + experts, params=(local_dense + local_experts) * width,
                          grads=sum(trainable) * 4, optimizer=optimizer, activations=acts,
                          optimizer_shards=shards)


def machine_memory(device) -> tuple[int, str]:
    """``(bytes, what)``: the memory a process of this job can use on ``device``."""
    if device.type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"{total / GIB:.1f} GiB on {torch.cuda.get_device_name(device)}"
    try:
        import psutil

        vm = psutil.virtual_memory()
        avail, total = vm.available, vm.total
    except ImportError:  # pragma: no cover - psutil is a dependency of the test suite
        info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        avail, total = (int(info[k].split()[0]) * 1024 for k in ("MemAvailable", "MemTotal"))
    return avail, f"{avail / GIB:.1f} GiB available of {total / GIB:.1f} GiB RAM"


def _processes_per_machine(device) -> int:
    if device.type == "cuda":
        return 1  # one device per process
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "").split("(")[0].split(",")[0]
        if value.isdigit():
            return int(value)
    return 1


def check_memory(cfg, available: Optional[int] = None, *, data_parallel_size: int = 1,
                 distributed_optimizer: bool = False) -> MemoryEstimate:
    """Refuse (ValueError) a job whose estimate (:func:`estimate_memory` with
    ``data_parallel_size`` and ``distributed_optimizer``) exceeds the machine's memory, saying
    both; ``training.skip_memory_check=true`` skips this. ``available`` overrides the measured
    bytes."""
    est = estimate_memory(cfg, data_parallel_size, distributed_optimizer)
    procs = _processes_per_machine(cfg.device)
    if available is not None:  # the device is not asked (planning for another machine)
        have, what = available, f"{available / GIB:.1f} GiB available"
    else:
        have, what = machine_memory(cfg.device)
    if est.total * procs > have:
        raise ValueError(
            f"this job will not fit: a {est.params_total / 1e9:.2f}B-parameter model needs an "
            f"estimated {est.describe()} per process"
            + (f" x {procs} processes on this machine" if procs > 1 else "")
            + f", and the {cfg.device.type} has {what}. Use a smaller model (e.g. "
            "model=tiny_dense), fastpath.lora=true, training.dtype=bfloat16, smaller "
            "data.max_tokens or more model-parallel ranks -- or training.skip_memory_check=true "
            "if you know better"
        )
    return est
