"""The refusal rules shared by every entry point, each written once.

The main job (``train/config.py``), the NeMo hook and the Megatron-Bridge hook
(``integrations/core.py``) describe the run they are asked for as :class:`RunFacts` and take
:func:`refusals` -- every reason it cannot run, all at once -- before they plan anything or
touch a device. A rule is a function of the facts; its message names the setting to change in
the entry point's own spelling (:class:`Names`), so one rule serves all three.

The entry points keep only what is theirs: parsing their config into facts, and rules about
settings only they have (the main job's groups and bounds; a framework recipe's layer spec,
build overrides and PEFT scheme). The main job's layout rules over facts only it sets (MoE
with TP, sequence parallelism, offload with pipelining, a full-iteration capture with
Megatron's optimizer step) live here too, in its spelling: its parse calls :func:`refusals`
once, with every fact, and its preflight once more with the GPU's capability added.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

__all__ = ["CP_ATTENTION_BACKENDS", "LINEAR_CROSS_ENTROPY_MIN_LOGITS", "NAMES", "Names", "RULES",
           "RunFacts", "default_linear_cross_entropy", "linear_cross_entropy_choice", "refusals"]


@dataclasses.dataclass(frozen=True)
class Names:
    """How an entry point spells the settings a refusal points at."""

    config: str  # "the job config" / "the recipe" / "the Bridge config"
    context_parallel: str  # the context-parallel size field
    virtual_pipeline: str
    micro_batch_size: str
    packing: str  # how to get packed sequences
    no_peft: str  # how "no PEFT" is spelled
    precision: str  # why FP8 cannot be set, and the fix
    graphs_off: str  # how per-layer CUDA graphs are turned off
    graph_warmup: str  # the capture warm-up passes setting
    capacity_factor: str  # the MoE capacity factor setting (static-shape dispatch)
    fp8_attention: str  # the FP8 dot-product attention flag
    bf16: str  # how to train in bf16
    fp8_on: str  # how FP8 is on
    fp8_off: str  # how to turn FP8 off
    fp8_recipe: str  # the FP8 recipe setting
    model_sizes: str  # the sizes that make a layer's per-rank GEMM shapes
    linear_cross_entropy: str  # the chunked linear cross-entropy's switch (its "off" spelling)


NAMES = {
    # the library used directly: a Megatron TransformerConfig and the spec functions
    "megatron": Names(
        config="the TransformerConfig",
        context_parallel="TransformerConfig.context_parallel_size",
        virtual_pipeline="TransformerConfig.virtual_pipeline_model_parallel_size",
        micro_batch_size="the micro-batch size",
        packing="load packed batches with PackedSeqCache.set_batch",
        no_peft="no LoRA spec transform",
        precision="TransformerConfig.fp8",
        graphs_off="TransformerConfig.cuda_graph_impl='none'",
        graph_warmup="TransformerConfig.cuda_graph_warmup_steps",
        capacity_factor="TransformerConfig.moe_expert_capacity_factor",
        fp8_attention="TransformerConfig.fp8_dot_product_attention",
        bf16="TransformerConfig.bf16 / params_dtype=torch.bfloat16",
        fp8_on="TransformerConfig.fp8",
        fp8_off="TransformerConfig.fp8=None",
        fp8_recipe="TransformerConfig.fp8_recipe",
        model_sizes=("hidden_size, num_attention_heads x kv_channels, ffn_hidden_size over "
                     "tensor_model_parallel_size; the packed length over context_parallel_size"),
        linear_cross_entropy="forward(..., linear_cross_entropy=False) (packed_seq/runtime.py)",
    ),
    "main": Names(
        config="the job config",
        context_parallel="parallel.context_parallel_size",
        virtual_pipeline="(no virtual pipeline in the main job)",
        micro_batch_size="(packed microbatches hold one row)",
        packing="(the main job always packs)",
        no_peft="fastpath.lora=false",
        precision="(fastpath.fp8=true sets FP8)",
        graphs_off="fastpath.cuda_graphs=false",
        graph_warmup="cuda_graphs.warmup_steps",
        capacity_factor="fastpath.moe_capacity_factor",
        fp8_attention="fp8.dot_product_attention",
        bf16="training.dtype=bfloat16",
        fp8_on="fastpath.fp8=true",
        fp8_off="fastpath.fp8=false",
        fp8_recipe="fp8.recipe",
        model_sizes=("model.hidden_size, model.num_attention_heads x kv_channels, "
                     "model.ffn_hidden_size over parallel.tensor_model_parallel_size; "
                     "data.max_tokens over parallel.context_parallel_size"),
        linear_cross_entropy="fastpath.linear_cross_entropy=off",
    ),
    "nemo": Names(
        config="the recipe",
        context_parallel="trainer.strategy.context_parallel_size",
        virtual_pipeline="trainer.strategy.virtual_pipeline_model_parallel_size",
        micro_batch_size="data.micro_batch_size",
        packing="build the recipe with packed_sequence=True, or pass packed_cache=False",
        no_peft="peft_scheme=None",
        precision=(
            "trainer.plugins is not a MegatronMixedPrecision config (NeMo sets FP8 there); add one, "
            "e.g. llm.recipes.precision.mixed_precision.bf16_with_fp8_mixed()"
        ),
        graphs_off="cuda_graphs=False",
        graph_warmup="model.config.cuda_graph_warmup_steps",
        capacity_factor="model.config.moe_expert_capacity_factor",
        fp8_attention="model.config.fp8_dot_product_attention",
        bf16="a bf16 precision plugin (trainer.plugins)",
        fp8_on="FP8 in the precision plugin or fp8=",
        fp8_off="fp8=False",
        fp8_recipe="the precision plugin's fp8_recipe",
        model_sizes=("model.config hidden_size, num_attention_heads x kv_channels, "
                     "ffn_hidden_size / moe_ffn_hidden_size over the tensor-parallel size; the "
                     "packed sequence size over the context-parallel size"),
        linear_cross_entropy="linear_cross_entropy='off'",
    ),
    "bridge": Names(
        config="the Bridge config",
        context_parallel="cfg.model.context_parallel_size",
        virtual_pipeline="cfg.model.virtual_pipeline_model_parallel_size",
        micro_batch_size="cfg.train.micro_batch_size",
        packing="cfg.dataset.packed_sequence_specs (Bridge <= 0.5) or offline_packing_specs (>= 0.6)",
        no_peft="cfg.peft is None",
        precision=(
            "cfg.mixed_precision is not a MixedPrecisionConfig object (resolve the named recipe "
            "first, e.g. get_mixed_precision_config(name))"
        ),
        graphs_off="cuda_graphs=False",
        graph_warmup="cfg.model.cuda_graph_warmup_steps",
        capacity_factor="cfg.model.moe_expert_capacity_factor",
        fp8_attention="cfg.model.fp8_dot_product_attention",
        bf16="a bf16 mixed-precision config (cfg.mixed_precision)",
        fp8_on="FP8 in cfg.mixed_precision or fp8=",
        fp8_off="fp8=False",
        fp8_recipe="cfg.mixed_precision.fp8_recipe",
        model_sizes=("cfg.model hidden_size, num_attention_heads x kv_channels, "
                     "ffn_hidden_size / moe_ffn_hidden_size over tensor_model_parallel_size; the "
                     "packed sequence size over context_parallel_size"),
        linear_cross_entropy="linear_cross_entropy='off'",
    ),
}


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What the rules read about a run, entry-point free.

    packed_cache: attention reads the packed-sequence cache (the hooks can swap only the MoE
        layer). graphs_requested: per-layer CUDA graphs are switched on (on a CPU the main
        job runs the graph-safety audit in their place); graphs_captured: they will be
        captured (a GPU run). graph_warmup_steps: Megatron's capture warm-up passes.
    moe_dropless_ep: an MoE model with expert parallelism > 1 and no capacity factor.
    expert_backend: "grouped_mm" or "te_grouped_linear".
    dtype: the compute dtype; capability: the GPU's (major, minor), None when there is no GPU
        to ask (a hook planning on a submit host).
    fp8_attention: FP8 dot-product attention asked for (with FP8 on).
    attention_backend: the resolved attention backend (None: not known yet).
    pipeline_parallel_size / sequence_parallel / offload: the layout and activation offload
        (known to the main job; the CP rule reads them).
    full_iteration: the whole step is captured (the main job's ``cuda_graphs.scope``).
    head_dim: the attention head width (kv_channels); None when not known.
    on_cpu: the job runs on a CPU (the main job's ``training.device``; the hooks train on GPUs).
    fp8_recipe: FP8's recipe when FP8 is on (None: off); fp8_gemms: (name, in, out) of each of a
        layer's Transformer Engine FP8 GEMMs on one tensor-parallel rank
        (``fp8.config.layer_gemms``); fp8_tokens: their inputs' leading dim on one rank
        (None: not known).
    tensor_parallel_size / linear_impl / packed_tokens: the TP size, the resolved linears
        ("local" | "te"; None: not known) and the tokens of one packed batch (the main job's
        data.max_tokens; None: not known) -- what sequence parallelism (and MoE with TP) needs.
    pad_multiple: the main job's data.pad_multiple (None: the hooks, whose framework packs).
    megatron_optimizer_step: the step runs Megatron's own optimizer ``step()`` (the main job's
        ``training.optimizer_step=megatron``), which reads values back to the host.
    linear_cross_entropy: the loss asked for ("chunked" | "off"; None: the default rule);
        logit_transforms: what changes the logits between the output layer and the loss, named.
    distributed_optimizer / overlap_grad_reduce / overlap_param_gather / bucket_size: Megatron's
        data-parallel optimizer as the main job resolved its ``parallel`` settings
        (``train/parallel.py``).

    The hooks leave the main job's own facts (TP size, sequence parallelism, offload, full
    iteration, the optimizer step) at their defaults: those rules read settings only the main
    job has.
    """

    names: Names
    packed_cache: bool = True
    context_parallel_size: int = 1
    graphs_requested: bool = False
    graphs_captured: bool = False
    graph_warmup_steps: int = 0
    lora: bool = False
    is_moe: bool = False
    moe_dropless_ep: bool = False
    expert_backend: str = "grouped_mm"
    dtype: Any = None
    capability: Optional[tuple] = None
    fp8_attention: bool = False
    attention_backend: Optional[str] = None
    pipeline_parallel_size: int = 1
    sequence_parallel: bool = False
    offload: bool = False
    full_iteration: bool = False
    head_dim: Optional[int] = None
    on_cpu: bool = False
    fp8_recipe: Optional[str] = None
    fp8_gemms: tuple = ()
    fp8_tokens: Optional[int] = None
    tensor_parallel_size: int = 1
    linear_impl: Optional[str] = None
    packed_tokens: Optional[int] = None
    pad_multiple: Optional[int] = None
    megatron_optimizer_step: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: Optional[int] = None
    linear_cross_entropy: Optional[str] = None
    logit_transforms: tuple = ()


# The attention backends that run context parallelism with the packed cache (what
# attention_backend=auto chooses from at CP > 1: attention/backend.py resolve_backend).
CP_ATTENTION_BACKENDS = ("sdpa", "te")


def _context_parallel(f: RunFacts) -> Optional[str]:
    # What runs (docs/configuration.md): the main job, dense model, TP (with SP: see below),
    # PP = 1, with the sdpa backend (CP over all-gathered K/V) -- with per-layer CUDA graphs too
    # (the all-gather and its backward all-reduce are captured in each layer's graphs and
    # replayed; on a CPU the audit: tests/train/test_context_parallel_graphs.py) -- or the te
    # backend (TE's THD + CP p2p ring; checked on CPU against a stand-in asserting TE's
    # contract: tests/train/test_context_parallel_te.py), eager or in per-layer CUDA graphs (TE
    # 2.9-2.11's THD + CP p2p path reads no device value on the host -- cu_seqlens stay on the
    # device, the ring is NCCL isend/irecv and stream waits, TE 2.10+ passes
    # cuda_graph=is_graph_capturing() to its fused-attention calls there -- so it captures;
    # the graphs are checked against the stand-in, whose mask is built on the device:
    # tests/train/test_context_parallel_te_graphs.py). Sequence parallelism is accepted with CP
    # under the conditions it has without CP (_sequence_parallel: TP >= 2, CUDA, TE's linears,
    # and data.max_tokens splitting over CP x TP): TE's linears run on a CPU only
    # on the test-only fake Transformer Engine (tests/te_standin: SP at TP=2, not yet with CP).
    # Everything else is refused until it is written and tested.
    if not (f.packed_cache and f.context_parallel_size > 1):
        return None
    cp = f"{f.names.context_parallel}={f.context_parallel_size}"
    served = "context parallelism with the packed cache is not served yet"
    if f.names is not NAMES["main"]:
        return (f"{served} ({cp}) through this entry point: only the main job (python -m "
                "megatron_fastpath.train) hands each CP rank its share of the packed batch; set "
                f"{f.names.context_parallel}=1, or use Megatron's own TE spec for CP without "
                "the cache")
    not_yet = [
        (f.attention_backend not in (None, *CP_ATTENTION_BACKENDS),
         f"the '{f.attention_backend}' attention backend (only 'sdpa' and 'te' run CP so far: "
         "queries against K/V all-gathered over the CP group, or Transformer Engine's THD + CP "
         "ring; flash's / flex's CP calls are not wired); use fastpath.attention_backend=sdpa "
         "or te"),
        (f.attention_backend == "te" and f.full_iteration,
         "the 'te' attention backend and cuda_graphs.scope=full_iteration (TE's CP ring is "
         "checked in per-layer graphs only); use cuda_graphs.scope=layers, or "
         "fastpath.attention_backend=sdpa"),
        (f.is_moe, "an MoE model (Megatron folds CP into the expert data-parallel group; the "
         "fastpath dispatcher is not checked with CP-sharded tokens); use a dense model"),
        (f.pipeline_parallel_size > 1, "pipeline parallelism (CP with PP is not tested); use "
         "parallel.pipeline_model_parallel_size=1"),
        (f.offload, "activation offload (not tested with CP); turn fastpath.offload off"),
    ]
    for hit, why in not_yet:
        if hit:
            return f"{served} ({cp}) with {why}, or set {f.names.context_parallel}=1"
    return None


def _fp8_thd_attention(f: RunFacts) -> Optional[str]:
    # TE 2.9-2.11 has no FP8 fused-attention backend for the THD (packed) format every backend
    # here feeds: DotProductAttention ends in "No dot product attention backend is available"
    # (TE's own CP tests skip it: "No support for FP8 attention with THD format!",
    # tests/pytorch/attention/test_attention_with_cp.py); other backends never read the flag.
    if f.packed_cache and f.fp8_attention:
        return (f"{f.names.fp8_attention}=true: Transformer Engine 2.9-2.11 has no FP8 attention "
                "backend for packed (THD) sequences, which this package always runs; keep "
                f"{f.names.fp8_attention}=false (linears still run in FP8)")
    return None


def _fp8_attention_inputs(f: RunFacts) -> Optional[str]:
    # Without the packed cache the framework's own attention is TE's DotProductAttention on
    # [s, b, h, d] (sbhd) inputs. TE 2.10 trains FP8 attention on cuDNN's fused FP8 backend only
    # (dot_product_attention/utils.py:468-480 turn flash-attn and the unfused backend off for
    # FP8), for bf16 / fp16 inputs (utils.py:444-465) on sm90+ with, in training, head_dim 128 on
    # sm90 and head_dim <= 128, % 16, on sm100+ (common/fused_attn/fused_attn.cpp:230-258); else
    # "No dot product attention backend is available" at the first forward.
    if f.packed_cache or not f.fp8_attention:
        return None
    import torch

    fix = f"keep {f.names.fp8_attention}=false (the linears still run in FP8)"
    if f.dtype is not None and f.dtype not in (torch.bfloat16, torch.float16):
        return (f"{f.names.fp8_attention}=true with {f.dtype} parameters: Transformer Engine "
                f"2.10's FP8 attention takes bf16 / fp16 inputs only; train in bf16 or {fix}")
    if f.fp8_recipe in ("mxfp8", "blockwise"):
        # Megatron-Core 0.16.1's get_fp8_recipe builds these without fp8_dpa (fp8_utils.py:565-571):
        # the flag would be silently ignored and attention run in bf16 / fp16
        return (f"{f.names.fp8_attention}=true with {f.names.fp8_recipe}={f.fp8_recipe}: "
                "Megatron-Core 0.16.1 builds that recipe without FP8 attention (fp8_dpa), so "
                f"attention would silently run in high precision; use the delayed recipe or {fix}")
    cap, d = f.capability, f.head_dim
    if f.fp8_recipe == "tensorwise" and cap is not None and cap < (10, 0):
        return (f"{f.names.fp8_attention}=true with {f.names.fp8_recipe}=tensorwise on "
                f"sm{cap[0]}{cap[1]}: Transformer Engine 2.10 runs FP8 attention with current "
                "scaling on sm100+ only (dot_product_attention/utils.py:484-487); use the delayed "
                f"recipe or {fix}")
    if cap is not None and cap < (9, 0):
        return (f"{f.names.fp8_attention}=true on a GPU of compute capability {cap[0]}.{cap[1]}: "
                f"Transformer Engine 2.10's FP8 attention (cuDNN) needs sm90 or newer; {fix}")
    if d is None:
        return None
    if cap is not None and cap < (10, 0) and d != 128:
        return (f"{f.names.fp8_attention}=true with head_dim {d} on sm{cap[0]}{cap[1]}: cuDNN's FP8 "
                "attention trains head_dim 128 only there (Transformer Engine 2.10, "
                f"fused_attn.cpp:246-249); {fix}")
    if d > 128 or d % 16:
        return (f"{f.names.fp8_attention}=true with head_dim {d}: cuDNN's FP8 attention trains "
                "head_dims divisible by 16 up to 128 (128 only on sm90; Transformer Engine 2.10, "
                f"fused_attn.cpp:246-251); {fix}")
    return None


def _flex_head_dim(f: RunFacts) -> Optional[str]:
    # On CUDA the flex backend runs torch.compile(flex_attention), whose Triton lowering refuses
    # a head narrower than 16 ("NYI: embedding dimension of the query, key, and value must be
    # at least 16", _inductor/kernel/flex/flex_attention.py: torch 2.13 :156-163, torch 2.11
    # :138-145) at the first forward; the CPU path runs flex eagerly (forward only) and has no
    # such limit.
    if f.attention_backend == "flex" and not f.on_cpu and f.head_dim is not None and f.head_dim < 16:
        return (f"the 'flex' attention backend with head_dim {f.head_dim} on a GPU: torch's "
                "compiled FlexAttention kernel needs a head width of at least 16 (torch "
                "_inductor/kernel/flex/flex_attention.py: 2.13 :156-163, 2.11 :138-145); use "
                "another attention backend "
                f"or a head_dim >= 16 ({f.names.model_sizes})")
    return None


def _fp8_gemm_shapes(f: RunFacts) -> Optional[str]:
    # TE asserts its FP8 GEMM shapes at the first forward (fp8.config.fp8_gemm_shape_problem)
    if f.fp8_recipe is None or f.fp8_tokens is None:
        return None
    from megatron_fastpath.fp8.config import fp8_gemm_shape_problem

    return fp8_gemm_shape_problem(f.fp8_recipe, list(f.fp8_gemms), f.fp8_tokens, f.names)


def _dropless_ep_in_graphs(f: RunFacts) -> Optional[str]:
    if f.graphs_requested and f.moe_dropless_ep:
        return ("dropless expert parallelism reads split sizes back to the host (one sync per "
                "layer), which aborts graph capture; set "
                f"{f.names.capacity_factor} for a static-shape all-to-all")
    return None


def _lora_graph_warmup(f: RunFacts) -> Optional[str]:
    if f.graphs_captured and f.lora and f.graph_warmup_steps > 0:
        return (f"LoRA with CUDA graphs needs {f.names.graph_warmup}=0: megatron-core 0.16.1's "
                "capture warm-up calls autograd.grad over the layer inputs only, and with a "
                "frozen embedding the first layer has none ('inputs argument to grad() cannot "
                "be empty'); the first step runs eagerly before capture anyway")
    return None


def _grouped_mm_in_graphs(f: RunFacts) -> Optional[str]:
    if not (f.graphs_captured and f.is_moe and f.expert_backend == "grouped_mm"
            and f.capability is not None):
        return None
    import torch

    from megatron_fastpath.moe.experts import grouped_mm_sync_free_refusal

    reason = grouped_mm_sync_free_refusal(f.dtype or torch.float32, tuple(f.capability))
    return f"{reason} ({f.names.bf16} / {f.names.graphs_off})" if reason else None


def _te_grouped_linear_in_graphs(f: RunFacts) -> Optional[str]:
    # TE's GroupedLinear takes the group sizes as a host list (m_splits): the experts read them
    # back inside the layer, which a captured graph cannot do (moe/experts.py).
    if f.graphs_captured and f.is_moe and f.expert_backend == "te_grouped_linear":
        return ("the te_grouped_linear experts with CUDA graphs: Transformer Engine's "
                "GroupedLinear takes the expert group sizes as a host list, a device read inside "
                "the captured MoE layer; use the grouped_mm experts (chosen by default when "
                f"graphs are on) or turn graphs off ({f.names.graphs_off})")
    return None


def _full_iteration_graphs(f: RunFacts) -> Optional[str]:
    # What runs (tests/train/test_full_iteration_graphs.py): dense, MoE (dropless and capacity)
    # and LoRA, every attention backend but flex (graphs/config.py), with DP / TP / EP / CP
    # collectives captured in the graphs; PP = 1.
    if f.full_iteration and f.pipeline_parallel_size > 1:
        return ("cuda_graphs.scope=full_iteration with pipeline parallelism: the 1F1B "
                "schedule's send/recv order across stages is not captured as one graph here; "
                "use parallel.pipeline_model_parallel_size=1, or cuda_graphs.scope=layers "
                "(per-layer graphs)")
    return None


def _moe_tensor_parallel(f: RunFacts) -> Optional[str]:
    # The sort/count dispatcher and the grouped experts shard experts over EP only
    # (expert_tensor_parallel_size 1; Megatron defaults it to the TP size), and
    # megatron-core 0.16.1's MoELayer.forward refuses TP > 1 without sequence parallelism
    # in training (transformer/moe/moe_layer.py), which the fastpath MoE layer lacks.
    if f.is_moe and f.tensor_parallel_size > 1:
        return (f"an MoE model with parallel.tensor_model_parallel_size={f.tensor_parallel_size}: "
                "the fastpath MoE layer shards experts over expert parallelism only, and "
                "megatron-core 0.16.1's MoE layer refuses tensor parallelism without sequence "
                "parallelism in training; use parallel.tensor_model_parallel_size=1 and "
                "parallel.expert_model_parallel_size for the experts")
    return None


def _sequence_parallel(f: RunFacts) -> Optional[str]:
    # Megatron's sequence parallelism (the main job's parallel.sequence_parallel): shards the
    # non-TP regions' sequence over the TP group, allocating its all-gathers on
    # torch.cuda.current_device(), through TE's norms and linears.
    if not f.sequence_parallel:
        return None
    tp, cp = f.tensor_parallel_size, f.context_parallel_size
    if tp < 2:
        return ("parallel.sequence_parallel=true needs "
                "parallel.tensor_model_parallel_size >= 2 (it shards over the TP group)")
    if f.on_cpu:
        return ("parallel.sequence_parallel needs CUDA: Megatron 0.16.1's sequence-parallel "
                "all-gathers allocate on torch.cuda.current_device(); use "
                "parallel.sequence_parallel=false on CPU (tensor parallelism still works)")
    tokens = f.packed_tokens
    if tokens is not None and cp > 1:
        # SP with CP (_context_parallel): each CP rank holds data.max_tokens / CP tokens (the
        # cache's local share, every piece split into 2 x CP chunks), and SP splits that share
        # over the TP ranks -- so max_tokens must split over 2 x CP (the cache's check) and over
        # CP x TP. Accepted on the conditions SP has without CP (TP >= 2, CUDA, TE's linears);
        # not run on a CPU yet (SP alone runs on the test-only fake Transformer Engine,
        # tests/te_standin).
        need = math.lcm(2 * cp, cp * tp)
        if tokens % need:
            return (f"parallel.sequence_parallel with parallel.context_parallel_size={cp}: each "
                    f"CP rank's data.max_tokens / {cp} tokens split over the {tp} TP ranks (and "
                    f"every packed piece into 2 x CP chunks): make data.max_tokens={tokens} "
                    f"a multiple of {need}")
    elif tokens is not None and tokens % tp:
        return (f"parallel.sequence_parallel splits each packed batch of data.max_tokens="
                f"{tokens} tokens over the {tp} TP ranks: make data.max_tokens a multiple "
                f"of {tp}")
    if f.linear_impl not in (None, "te"):
        return ("parallel.sequence_parallel needs Transformer Engine's norms and linears "
                "(fastpath.linear_impl=te): Megatron's local spec uses torch norms, which refuse "
                "sequence parallelism")
    return None


def _pad_multiple(f: RunFacts) -> Optional[str]:
    # The main job packs every sample counted as its length rounded up to data.pad_multiple
    # (data.py pack_microbatches), whatever the CP size: the packed cache pads each sequence to
    # 2 x CP (packed_seq/context_parallel.py; Megatron's THD + CP contract, each document a
    # multiple of 2 x cp_size: megatron/core/utils.py:2413-2414 at 0.19.2), which fits the bin
    # only when 2 x CP divides pad_multiple; and a sample of up to data.max_tokens tokens counted
    # padded fits a bin only when pad_multiple divides data.max_tokens.
    pad, tokens, cp = f.pad_multiple, f.packed_tokens, f.context_parallel_size
    if pad is None:
        return None
    if cp > 1 and pad % (2 * cp):  # at CP 1 the cache pads nothing
        fix = math.lcm(pad, 2 * cp)
        return (f"data.pad_multiple={pad} with {f.names.context_parallel}={cp}: the packed cache "
                f"pads every sample to a multiple of 2 x CP = {2 * cp}, which fits the packing "
                f"only when it divides data.pad_multiple; set data.pad_multiple={fix}")
    if tokens is not None and tokens % pad:
        up = -(-tokens // pad) * pad
        return (f"data.max_tokens={tokens} is not a multiple of data.pad_multiple={pad}: a sample "
                f"of up to data.max_tokens tokens counted padded to {pad} would not fit a "
                f"microbatch; set data.max_tokens={up} (or a data.pad_multiple dividing it)")
    return None


def _offload_with_pipeline(f: RunFacts) -> Optional[str]:
    if f.offload and f.pipeline_parallel_size > 1:
        return ("fastpath.offload with pipeline parallelism is not supported yet (one pass in flight "
                "per offload manager); use parallel.pipeline_model_parallel_size=1")
    return None


def _full_iteration_megatron_step(f: RunFacts) -> Optional[str]:
    if f.full_iteration and f.megatron_optimizer_step:
        return ("cuda_graphs.scope=full_iteration captures the optimizer step as a graph: Megatron's "
                "own step reads the gradient norm and found-inf back to the host (.item()), which a "
                "capture cannot do; use training.optimizer_step=auto or sync_free")
    return None


def _data_parallel_optimizer(f: RunFacts) -> Optional[str]:
    """Megatron's distributed optimizer and overlapped reduce / gather (the main job's
    ``parallel`` settings) where Megatron cannot run them."""
    asked = [f"parallel.{k}=true" for k in ("distributed_optimizer", "overlap_grad_reduce",
                                             "overlap_param_gather") if getattr(f, k)]
    if f.on_cpu and (asked or f.bucket_size is not None):
        what = " and ".join(asked) or f"parallel.bucket_size={f.bucket_size}"
        return (f"{what} with training.device=cpu: the CPU step runs its own loop with torch "
                "AdamW, not Megatron's DistributedDataParallel and DistributedOptimizer; set "
                "parallel.distributed_optimizer, overlap_grad_reduce and overlap_param_gather "
                "to false (or null) and bucket_size to null, or train on CUDA")
    if f.overlap_param_gather and not f.distributed_optimizer:
        # megatron-core 0.16.1 distributed/param_and_grad_buffer.py:262 (start_param_sync:
        # ``assert self.ddp_config.use_distributed_optimizer``); Megatron-LM's arguments.py
        # (core_v0.16.1 megatron/training/arguments.py:597-599) asserts it at start-up
        return ("parallel.overlap_param_gather=true needs parallel.distributed_optimizer=true: "
                "without it there is no parameter all-gather to overlap (Megatron asserts "
                "use_distributed_optimizer in start_param_sync); set "
                "parallel.distributed_optimizer=true or parallel.overlap_param_gather=false")
    if f.overlap_param_gather and not f.overlap_grad_reduce:
        # core_v0.16.1 megatron/training/arguments.py:600-601
        return ("parallel.overlap_param_gather=true needs parallel.overlap_grad_reduce=true (as "
                "Megatron-LM asserts: 'Must use --overlap-param-gather with "
                "--overlap-grad-reduce'); set parallel.overlap_grad_reduce=true or "
                "parallel.overlap_param_gather=false")
    if f.bucket_size is not None and not f.overlap_grad_reduce:
        # megatron-core 0.16.1 distributed/distributed_data_parallel.py:66-68
        return (f"parallel.bucket_size={f.bucket_size} without parallel.overlap_grad_reduce: "
                "Megatron's DDP then puts every gradient in one bucket and drops the size; set "
                "parallel.overlap_grad_reduce=true or parallel.bucket_size=null")
    return None


def _data_parallel_in_full_iteration(f: RunFacts) -> Optional[str]:
    # Megatron's DDP hooks return at once while a graph is being captured (megatron-core 0.16.1
    # distributed/distributed_data_parallel.py:395-396 forward pre-hook, :428-429 backward
    # post-hook): a captured backward dispatches no bucket reduce-scatter and a captured forward
    # waits on no all-gather, so neither overlap can live in the full-iteration graphs. The
    # distributed optimizer without them runs there: the reduce-scatter is captured in the
    # forward-backward graph (finalize_model_grads), the shard's step and the parameter
    # all-gather in the optimizer graph.
    asked = [f"parallel.{k}=true" for k in ("overlap_grad_reduce", "overlap_param_gather")
             if getattr(f, k)]
    if f.full_iteration and asked:
        return (f"cuda_graphs.scope=full_iteration with {' and '.join(asked)}: Megatron's DDP "
                "skips its gradient-reduce and parameter-gather hooks while a graph is "
                "captured, so the captured step would reduce and gather nothing; set "
                "parallel.overlap_grad_reduce and parallel.overlap_param_gather to false (or "
                "null), or use cuda_graphs.scope=layers")
    return None


# linear_cross_entropy=null: chunked from this many elements of one rank's logits [T/CP, V/TP] on: 4 chunks,
# half Megatron's peak (benchmarks/results/linear_cross_entropy.json; docs/benchmarks.md: no gain <= 2**27)
LINEAR_CROSS_ENTROPY_MIN_LOGITS = 2**28


def default_linear_cross_entropy(tokens: int, vocab_per_rank: int) -> str:
    """The default loss of one rank's ``tokens`` x ``vocab_per_rank`` logits: "chunked" or "off"."""
    return "chunked" if tokens * vocab_per_rank >= LINEAR_CROSS_ENTROPY_MIN_LOGITS else "off"


def linear_cross_entropy_choice(asked: Optional[str], transforms: tuple, tokens: Optional[int],
                                vocab_per_rank: Optional[int]) -> Optional[str]:
    """``asked`` when set; else "off" where something transforms the logits before the loss,
    else :func:`default_linear_cross_entropy` (None: the sizes are not known yet)."""
    if asked is not None or transforms:
        return asked or "off"
    return None if not (tokens and vocab_per_rank) else default_linear_cross_entropy(tokens, vocab_per_rank)


def _linear_cross_entropy(f: RunFacts) -> Optional[str]:
    # The chunked loss replaces the output layer's forward and what follows it before the loss:
    # MuP's _scale_logits (0.19.2 language_module.py:320-337), 0.16.1's multi-token prediction
    # from the logits (gpt_model.py:611-660), Gemma's soft-capping hook (gemma.py).
    if f.linear_cross_entropy == "chunked" and f.logit_transforms:
        return (f"the chunked linear cross-entropy with {' and '.join(f.logit_transforms)}: it "
                "computes the loss from the output weight directly and would skip what changes "
                f"the logits before the loss; set {f.names.linear_cross_entropy} (null picks it here)")
    return None


RULES: tuple[Callable[[RunFacts], Optional[str]], ...] = (
    _context_parallel,
    _full_iteration_graphs,
    _fp8_thd_attention,
    _fp8_attention_inputs,
    _flex_head_dim,
    _fp8_gemm_shapes,
    _dropless_ep_in_graphs,
    _lora_graph_warmup,
    _grouped_mm_in_graphs,
    _te_grouped_linear_in_graphs,
    _moe_tensor_parallel,
    _sequence_parallel,
    _pad_multiple,
    _offload_with_pipeline,
    _full_iteration_megatron_step,
    _data_parallel_optimizer,
    _data_parallel_in_full_iteration,
    _linear_cross_entropy,
)


def refusals(facts: RunFacts) -> list[str]:
    """Every reason the run described by ``facts`` cannot run (empty: it can)."""
    return [r for r in (rule(facts) for rule in RULES) if r]
