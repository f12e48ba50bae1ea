"""megatron_fastpath.rules: each shared refusal written once and used by the main job, the NeMo
hook and the Megatron-Bridge hook. For every rule: a run that breaks it is
refused by each entry point with the rule's own message in that entry point's spelling, and
the message's text exists in one file of the package."""

import ast
import os

import pytest
import torch

import megatron_fastpath
from megatron_fastpath import rules
from megatron_fastpath.integrations import core

# one run per rule that breaks only that rule
BREAKS = {
    "_context_parallel": dict(context_parallel_size=2, attention_backend="flash"),
    "_fp8_thd_attention": dict(fp8_attention=True),
    "_fp8_attention_inputs": dict(packed_cache=False, fp8_attention=True, dtype=torch.float32),
    "_fp8_gemm_shapes": dict(fp8_recipe="delayed", fp8_gemms=(("linear_qkv", 24, 64),), fp8_tokens=64),
    "_dropless_ep_in_graphs": dict(graphs_requested=True, is_moe=True, moe_dropless_ep=True),
    "_lora_graph_warmup": dict(graphs_requested=True, graphs_captured=True, lora=True,
                               graph_warmup_steps=3),
    "_grouped_mm_in_graphs": dict(graphs_requested=True, graphs_captured=True, is_moe=True,
                                  dtype=torch.float32, capability=(9, 0)),
    "_te_grouped_linear_in_graphs": dict(graphs_requested=True, graphs_captured=True, is_moe=True,
                                         expert_backend="te_grouped_linear"),
    "_full_iteration_graphs": dict(full_iteration=True, pipeline_parallel_size=2),
    "_flex_head_dim": dict(attention_backend="flex", head_dim=8),
    "_moe_tensor_parallel": dict(is_moe=True, tensor_parallel_size=2),
    "_sequence_parallel": dict(sequence_parallel=True),
    "_pad_multiple": dict(pad_multiple=8, packed_tokens=100),
    "_offload_with_pipeline": dict(offload=True, pipeline_parallel_size=2),
    "_full_iteration_megatron_step": dict(full_iteration=True, megatron_optimizer_step=True),
    "_data_parallel_optimizer": dict(on_cpu=True, distributed_optimizer=True),
    "_data_parallel_in_full_iteration": dict(full_iteration=True, distributed_optimizer=True,
                                             overlap_grad_reduce=True),
    "_linear_cross_entropy": dict(linear_cross_entropy="chunked", logit_transforms=("MuP's logit scaling (use_mup)",)),
}
# a phrase of each rule's message: the test below finds it in rules.py only
PHRASES = {
    "_context_parallel": "context parallelism with the packed cache is not served yet",
    "_fp8_thd_attention": "no FP8 attention backend for packed (THD) sequences",
    "_fp8_attention_inputs": "FP8 attention takes bf16 / fp16 inputs only",
    "_fp8_gemm_shapes": "Transformer Engine's FP8 GEMMs need leading dims",
    "_dropless_ep_in_graphs": "which aborts graph capture",
    "_lora_graph_warmup": "inputs argument to grad() cannot be empty",
    "_grouped_mm_in_graphs": "sync-free path",
    "_te_grouped_linear_in_graphs": "takes the expert group sizes as a host list",
    "_full_iteration_graphs": "1F1B schedule's send/recv order across stages",
    "_flex_head_dim": "compiled FlexAttention kernel needs a head width of at least 16",
    "_moe_tensor_parallel": "the fastpath MoE layer shards experts over expert parallelism only",
    "_sequence_parallel": "needs parallel.tensor_model_parallel_size >= 2",
    "_pad_multiple": "is not a multiple of data.pad_multiple",
    "_offload_with_pipeline": "one pass in flight per offload manager",
    "_full_iteration_megatron_step": "captures the optimizer step as a graph",
    "_data_parallel_optimizer": "the CPU step runs its own loop with torch AdamW",
    "_data_parallel_in_full_iteration": "skips its gradient-reduce and parameter-gather hooks",
    "_linear_cross_entropy": "would skip what changes the logits before the loss",
}


def test_every_rule_has_a_breaking_run_and_a_phrase():
    assert {r.__name__ for r in rules.RULES} == set(BREAKS) == set(PHRASES)


@pytest.mark.parametrize("entry", sorted(rules.NAMES))
@pytest.mark.parametrize("rule", sorted(BREAKS))
def test_each_rule_fires_alone_in_each_spelling(rule, entry):
    names = rules.NAMES[entry]
    reasons = rules.refusals(rules.RunFacts(names=names, **BREAKS[rule]))
    assert len(reasons) == 1 and PHRASES[rule] in reasons[0], reasons
    assert rules.refusals(rules.RunFacts(names=names)) == []


def test_rule_messages_exist_once_in_the_package():
    root = os.path.dirname(megatron_fastpath.__file__)
    found = {phrase: [] for phrase in PHRASES.values()}
    for dirpath, _, files in os.walk(root):
        for fn in files:
            if fn.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, fn), root)
                strings = " ".join(n.value for n in ast.walk(ast.parse(open(os.path.join(dirpath, fn)).read()))
                                   if isinstance(n, ast.Constant) and isinstance(n.value, str))
                for phrase in found:
                    if phrase.split(" (")[0][:30] in strings:
                        found[phrase].append(rel)
    assert {p: f for p, f in found.items()} == {
        **{p: ["rules.py"] for p in PHRASES.values()
           if p not in (PHRASES["_grouped_mm_in_graphs"], PHRASES["_fp8_gemm_shapes"])},
        # the grouped_mm reason itself is the experts' own (moe/experts.py), wrapped by the rule
        PHRASES["_grouped_mm_in_graphs"]: [os.path.join("moe", "experts.py")],
        # the GEMM shapes' reason is fp8/config.py's (TE's assert per recipe), returned by the rule
        PHRASES["_fp8_gemm_shapes"]: [os.path.join("fp8", "config.py")],
    }


# ------------------------------------------------------------------ the three entry points
def _main_job_error(overrides):
    from tests.support.hydra_compose import compose_job
    from megatron_fastpath.train.config import parse_job_config

    with pytest.raises(ValueError) as info:
        parse_job_config(compose_job(overrides + ["training.skip_memory_check=true"]))
    return str(info.value)


def _hook_facts(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    model = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                              num_moe_experts=4, moe_ffn_hidden_size=64, add_bias_linear=False)
    for k, v in overrides.pop("model", {}).items():
        setattr(model, k, v)
    fields = dict(names=rules.NAMES["bridge"], model=model, custom_layer_spec=None,
                  build_override=None, llama31_rope=None, context_parallel_size=1,
                  virtual_pipeline_size=None, pipeline_size=1, packed_size=64, micro_batch_size=1,
                  graphs_on=False, has_precision=True, fp8_on=False, peft=None)
    fields.update(overrides)
    return core.ModelFacts(**fields)


LORA = core.PeftFacts("LoRA", True, ("linear_qkv",))


@pytest.mark.parametrize("rule, main_overrides, hook", [
    # the main job serves CP (dense, sdpa): it refuses what is not served yet (test below)
    ("_context_parallel", None,
     (dict(context_parallel_size=2), core.HookRequest())),
    ("_fp8_thd_attention", ["fastpath.fp8=true", "fp8.dot_product_attention=true"],
     (dict(model=dict(fp8_dot_product_attention=True)), core.HookRequest(fp8="hybrid"))),
    ("_dropless_ep_in_graphs", ["model=tiny_moe", "parallel=ep2", "fastpath.cuda_graphs=true"],
     (dict(expert_parallel_size=2, graphs_on=True), core.HookRequest())),
    # the hooks write warm-up 0 when they turn graphs on for LoRA; graphs already on are checked
    ("_lora_graph_warmup", None,
     (dict(graphs_on=True, peft=LORA, model=dict(cuda_graph_warmup_steps=2)), core.HookRequest())),
    # the main job's GPU path: test_main_job_refuses_narrow_flex_heads_on_a_gpu_only
    ("_flex_head_dim", None,
     (dict(model=dict(kv_channels=8)), core.HookRequest(attention_backend="flex"))),
    # the main job's logit transform is Gemma's soft-capping: test_linear_cross_entropy_refusals
    ("_linear_cross_entropy", None,
     (dict(model=dict(use_mup=True)), core.HookRequest(linear_cross_entropy="chunked"))),
])
def test_main_job_and_hooks_refuse_with_the_rules_message(rule, main_overrides, hook):
    facts_kw, request = hook
    want = rules.refusals(rules.RunFacts(names=rules.NAMES["bridge"], **BREAKS[rule]))
    assert len(want) == 1 and want[0] in core.refusals(_hook_facts(**facts_kw), request)
    if main_overrides is not None:
        expect = rules.refusals(rules.RunFacts(names=rules.NAMES["main"], **BREAKS[rule]))
        assert _main_job_error(main_overrides) == expect[0]


@pytest.mark.parametrize("kv_channels, refused", [(8, True), (16, False), (None, False)])
def test_main_job_refuses_narrow_flex_heads_on_a_gpu_only(kv_channels, refused):
    """Heads 8 wide: flex is refused on the GPU path (parsed on the CUDA-as-CPU stand-ins)
    with the rule's message; accepted at 16, at the tiny model's own 32 (128 / 4), and on a
    CPU (eager) at any width."""
    from tests.support.graph_safe_standins import gpu_standins
    from tests.support.hydra_compose import compose_job
    from megatron_fastpath.train.config import parse_job_config

    kv = [] if kv_channels is None else [f"model.kv_channels={kv_channels}"]
    base = ["model=tiny_dense", "fastpath.attention_backend=flex",
            "training.skip_memory_check=true"] + kv
    assert parse_job_config(compose_job(base)).attention_backend == "flex"  # on a CPU
    gpu = compose_job(base + ["training.device=cuda", "cluster.backend=gloo"])
    with gpu_standins():
        if not refused:
            assert parse_job_config(gpu).attention_backend == "flex"
            return
        with pytest.raises(ValueError) as info:
            parse_job_config(gpu)
    want = rules.refusals(rules.RunFacts(names=rules.NAMES["main"], **BREAKS["_flex_head_dim"]))
    assert str(info.value) == want[0]


def test_main_job_refuses_cp_only_where_it_is_not_served():
    expect = rules.refusals(rules.RunFacts(names=rules.NAMES["main"], context_parallel_size=2,
                                           is_moe=True))
    assert len(expect) == 1 and "an MoE model" in expect[0]
    assert _main_job_error(["parallel.context_parallel_size=2", "model=tiny_moe"]) == expect[0]
    # what only the resolved job knows (backend, layout, offload) is refused at parse too, with
    # the rule's message (build_job refused these before, after the parse)
    for overrides, facts in ((["fastpath.attention_backend=flex"], dict(attention_backend="flex")),
                             (["fastpath.offload=true"], dict(attention_backend="sdpa", offload=True)),
                             (["parallel.pipeline_model_parallel_size=2", "model.num_layers=2"],
                              dict(attention_backend="sdpa", pipeline_parallel_size=2))):
        want = rules.refusals(rules.RunFacts(names=rules.NAMES["main"], context_parallel_size=2, **facts))
        assert _main_job_error(["parallel.context_parallel_size=2", *overrides]) == want[0], overrides
    for facts in (dict(attention_backend="flex"), dict(pipeline_parallel_size=2), dict(offload=True),
                  dict(attention_backend="te", graphs_requested=True, full_iteration=True)):
        assert len(rules.refusals(rules.RunFacts(names=rules.NAMES["main"], context_parallel_size=2,
                                                 **facts))) == 1, facts
    assert rules.refusals(rules.RunFacts(names=rules.NAMES["main"], context_parallel_size=2,
                                         attention_backend="sdpa", lora=True)) == []
    # CUDA graphs at CP (captured on a GPU, the audit on a CPU) are served, per-layer ones with
    # the te backend too: tests/train/test_context_parallel_graphs.py, _te_graphs.py
    for graphs in (dict(graphs_requested=True), dict(graphs_requested=True, graphs_captured=True)):
        for backend in ("sdpa", "te"):
            assert rules.refusals(rules.RunFacts(names=rules.NAMES["main"], context_parallel_size=2,
                                                 attention_backend=backend, **graphs)) == []
    # sequence parallelism with CP: left to the conditions SP has without CP
    # (rules._sequence_parallel; tests/train/test_llama2_70b_lora_preset.py)
    assert rules.refusals(rules.RunFacts(names=rules.NAMES["main"], context_parallel_size=2,
                                         attention_backend="te", sequence_parallel=True,
                                         tensor_parallel_size=2, linear_impl="te")) == []
    from megatron_fastpath.train.config import parse_job_config
    from tests.support.hydra_compose import compose_job

    job = parse_job_config(compose_job(["parallel.context_parallel_size=2", "fastpath.cuda_graphs=true",
                                        "training.skip_memory_check=true"]))
    assert job.parallel.context_parallel_size == 2 and job.plan.audit  # the CPU runs the audit
    want = rules.refusals(rules.RunFacts(names=rules.NAMES["main"], context_parallel_size=2,
                                         graphs_requested=True, attention_backend="flex"))
    assert _main_job_error(["parallel.context_parallel_size=2", "fastpath.cuda_graphs=true",
                            "fastpath.attention_backend=flex"]) == want[0]


def test_main_job_refuses_a_pad_multiple_that_2cp_does_not_divide():
    """The packing pads to data.pad_multiple at every CP size: its default 8 serves CP 1, 2 and
    4; CP 8 (the cache pads each sequence to 16) and a data.max_tokens the padded samples do
    not fill are refused at parse with the rule's one line; data.pad_multiple=1 runs at CP 1."""
    from megatron_fastpath.train.config import parse_job_config
    from tests.support.hydra_compose import compose_job

    for cp in (1, 2, 4):
        job = parse_job_config(compose_job([f"parallel.context_parallel_size={cp}",
                                            "training.skip_memory_check=true"]))
        assert job.data.pad_multiple == 8 and job.facts.pad_multiple == 8
    want = rules.refusals(rules.RunFacts(names=rules.NAMES["main"], context_parallel_size=8,
                                         attention_backend="sdpa", pad_multiple=8, packed_tokens=512))
    assert want == ["data.pad_multiple=8 with parallel.context_parallel_size=8: the packed cache "
                    "pads every sample to a multiple of 2 x CP = 16, which fits the packing only "
                    "when it divides data.pad_multiple; set data.pad_multiple=16"]
    assert _main_job_error(["parallel.context_parallel_size=8"]) == want[0]
    assert _main_job_error(["data.pad_multiple=6", "parallel.context_parallel_size=2"]).endswith(
        "set data.pad_multiple=12")
    assert _main_job_error(["data.max_tokens=500"]) == rules.refusals(rules.RunFacts(
        names=rules.NAMES["main"], pad_multiple=8, packed_tokens=500))[0]
    assert "set data.max_tokens=504" in _main_job_error(["data.max_tokens=500"])
    assert parse_job_config(compose_job(["parallel.context_parallel_size=8", "data.pad_multiple=16",
                                         "training.skip_memory_check=true"])).data.pad_multiple == 16
    assert parse_job_config(compose_job(["data.pad_multiple=1", "data.max_tokens=500",
                                         "training.skip_memory_check=true"])).data.pad_multiple == 1


def test_hooks_turning_graphs_on_for_lora_write_zero_warmup():
    facts = _hook_facts(peft=LORA, model=dict(cuda_graph_warmup_steps=3, num_moe_experts=None))
    assert [r for r in core.refusals(facts, core.HookRequest(cuda_graphs=True))
            if PHRASES["_lora_graph_warmup"] in r] == []
    assert core.plan(facts, core.HookRequest(cuda_graphs=True)).graph_warmup_steps == 0
    assert core.plan(facts, core.HookRequest()).graph_warmup_steps is None  # graphs left alone


def test_packed_core_attention_refuses_cp_with_the_rule():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_fastpath.attention.core_attention import PackedCoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    config.context_parallel_size = 2
    want = rules.refusals(rules.RunFacts(names=rules.NAMES["megatron"], context_parallel_size=2))[0]
    with pytest.raises(ValueError) as info:
        PackedCoreAttention(config, 1, None, cache=None)
    assert str(info.value) == want


@pytest.mark.parametrize("capability, head_dim, refused", [
    (None, 128, False), (None, 64, False), (None, 8, True), (None, 256, True), (None, None, False),
    ((8, 9), 128, True), ((8, 0), 128, True),
    ((9, 0), 128, False), ((9, 0), 64, True), ((9, 0), 256, True),
    ((10, 0), 128, False), ((10, 0), 64, False), ((10, 0), 80, False), ((10, 0), 72, True),
    ((10, 0), 256, True), ((12, 0), 96, False),
])
def test_fp8_attention_without_the_cache_takes_what_cudnn_trains(capability, head_dim, refused):
    """TE 2.10's FP8 attention on Megatron's own sbhd attention (no packed cache): bf16 / fp16,
    sm90+, head_dim 128 on sm90, <= 128 and % 16 on sm100+ (fused_attn.cpp:230-258); an
    unknown GPU refuses only what no GPU trains."""
    facts = dict(names=rules.NAMES["bridge"], packed_cache=False, fp8_attention=True,
                 dtype=torch.bfloat16, capability=capability, head_dim=head_dim)
    assert bool(rules.refusals(rules.RunFacts(**facts))) == refused
    assert rules.refusals(rules.RunFacts(**dict(facts, fp8_attention=False))) == []
    # the packed cache's THD attention is the other rule's, whatever the shape
    assert [r for r in rules.refusals(rules.RunFacts(**dict(facts, packed_cache=True)))
            if "THD" not in r] == []


def test_hooks_read_the_head_dim_of_the_model_config():
    assert core.run_facts(_hook_facts(model=dict(fp8_dot_product_attention=True)),
                          core.HookRequest(fp8="hybrid")).head_dim == _hook_facts().model.hidden_size // \
        _hook_facts().model.num_attention_heads
    assert core.run_facts(_hook_facts(model=dict(kv_channels=128)), core.HookRequest()).head_dim == 128


def test_hooks_refuse_the_fp8_gemm_shapes_te_refuses():
    """The FP8 GEMM shapes TE asserts at the first forward, refused by the hooks too (before,
    the main job only): per TP rank (an 8-wide linear_proj split at TP 4 of a 32-wide model),
    MXFP8's blocks of 32 (16 packed tokens per CP rank), and the te_grouped_linear experts' own
    GEMMs (a 24-wide expert FFN), each with the hook's spelling."""
    fp8_model = dict(fp8_dot_product_attention=False)
    ok = core.refusals(_hook_facts(model=fp8_model), core.HookRequest(fp8="hybrid", moe_expert_backend="grouped_mm"))
    assert ok == [], ok
    tp8 = _hook_facts(model=dict(tensor_model_parallel_size=8, num_moe_experts=None, ffn_hidden_size=128,
                                 num_attention_heads=2, num_query_groups=2, kv_channels=32))
    reasons = core.refusals(tp8, core.HookRequest(fp8="hybrid"))
    assert [r for r in reasons if "linear_proj on a rank is 64 tokens x 8 -> 64" in r and "fp8=False" in r], reasons
    mx = core.refusals(_hook_facts(packed_size=32, context_parallel_size=1),
                       core.HookRequest(fp8="hybrid", fp8_recipe="mxfp8", moe_expert_backend="grouped_mm"))
    assert mx == [], mx
    mx = core.run_facts(_hook_facts(packed_size=32, context_parallel_size=2),
                        core.HookRequest(fp8="hybrid", fp8_recipe="mxfp8"))
    assert "16 tokens" in rules._fp8_gemm_shapes(mx) and "fp8_recipe" in rules._fp8_gemm_shapes(mx)
    experts = core.run_facts(_hook_facts(model=dict(moe_ffn_hidden_size=24)),
                             core.HookRequest(fp8="hybrid", moe_expert_backend="te_grouped_linear"))
    assert "experts.linear_fc1" in rules._fp8_gemm_shapes(experts)
    assert core.run_facts(_hook_facts(), core.HookRequest(fp8=False)).fp8_recipe is None


@pytest.mark.parametrize("recipe, capability, refused", [
    ("delayed", (9, 0), False), ("delayed", None, False), ("tensorwise", (10, 0), False),
    ("tensorwise", (9, 0), True), ("tensorwise", None, False),
    ("mxfp8", (10, 0), True), ("blockwise", (9, 0), True), ("mxfp8", None, True),
])
def test_fp8_attention_recipes_te_and_megatron_run(recipe, capability, refused):
    """FP8 attention per recipe: current scaling (tensorwise) needs sm100+ in TE 2.10
    (dot_product_attention/utils.py:484-487); Megatron 0.16.1 builds mxfp8 / blockwise without
    fp8_dpa (fp8_utils.py:565-571): refused, not silently high precision."""
    facts = rules.RunFacts(names=rules.NAMES["nemo"], packed_cache=False, fp8_attention=True,
                           dtype=torch.bfloat16, capability=capability, head_dim=128, fp8_recipe=recipe)
    reasons = rules.refusals(facts)
    assert bool(reasons) == refused, reasons
    if refused:
        assert "the precision plugin's fp8_recipe=" in reasons[0], reasons


def test_linear_cross_entropy_default_rule_by_the_threshold():
    """fastpath.linear_cross_entropy=null: chunked from LINEAR_CROSS_ENTROPY_MIN_LOGITS elements
    of one rank's logits (data.max_tokens / CP x model.vocab_size / TP) on, off below; a value
    set is kept either side; the hooks choose by the same rule from the config's vocabulary
    (None, chosen at the first forward, when the config has none)."""
    from tests.support.hydra_compose import compose_job
    from megatron_fastpath.train.config import parse_job_config

    limit = rules.LINEAR_CROSS_ENTROPY_MIN_LOGITS
    assert rules.default_linear_cross_entropy(limit // 1024, 1024) == "chunked"
    assert rules.default_linear_cross_entropy(limit // 1024 - 1, 1024) == "off"

    def chosen(vocab, value="null"):
        return parse_job_config(compose_job([
            "data.max_tokens=1024", f"model.vocab_size={vocab}", "training.skip_memory_check=true",
            f"fastpath.linear_cross_entropy={value}"])).linear_cross_entropy

    assert (chosen(limit // 1024), chosen(limit // 1024 - 1)) == ("chunked", "off")
    assert (chosen(limit // 1024, "off"), chosen(64, "chunked")) == ("off", "chunked")
    hook = dict(packed_size=1024, model=dict(tensor_model_parallel_size=2))
    for vocab, want in ((2 * limit // 1024, "chunked"), (2 * limit // 1024 - 2, "off"), (None, None)):
        plan = core.plan(_hook_facts(**dict(hook, model=dict(hook["model"], vocab_size=vocab))),
                         core.HookRequest())
        assert plan.settings["linear_cross_entropy"] == want, vocab


def test_linear_cross_entropy_refusals(tmp_path):
    """The chunked loss with what changes the logits before the loss is refused before any
    device work, naming it; null picks off there: the main job with a Gemma 2 checkpoint
    (final-logit soft-capping), the hooks with MuP's scaling; a bad value, and chunked without
    the hooks' forward step (packed_cache=False), are refused too."""
    from tests.hf.hf_reference import make_checkpoint
    from tests.support.hydra_compose import compose_job
    from megatron_fastpath.train.config import parse_job_config

    make_checkpoint("gemma2", str(tmp_path))
    gemma = ["model=hf", f"model.path={tmp_path}"]
    assert _main_job_error(gemma + ["fastpath.linear_cross_entropy=chunked"]) == (
        "the chunked linear cross-entropy with Gemma's final-logit soft-capping (2.0): it computes "
        "the loss from the output weight directly and would skip what changes the logits before "
        "the loss; set fastpath.linear_cross_entropy=off (null picks it here)")
    job = parse_job_config(compose_job(gemma + ["data.max_tokens=1024", "training.skip_memory_check=true"]))
    assert job.linear_cross_entropy == "off"
    assert _main_job_error(["fastpath.linear_cross_entropy=fused"]) == (
        "fastpath.linear_cross_entropy must be chunked, off or null; got 'fused'")
    mup = _hook_facts(model=dict(use_mup=True, vocab_size=2 * rules.LINEAR_CROSS_ENTROPY_MIN_LOGITS))
    assert core.plan(mup, core.HookRequest()).settings["linear_cross_entropy"] == "off"
    assert "with MuP's logit scaling (use_mup)" in " ".join(
        core.refusals(mup, core.HookRequest(linear_cross_entropy="chunked")))
    plain = _hook_facts()
    assert core.refusals(plain, core.HookRequest(linear_cross_entropy="fused")) == [
        "linear_cross_entropy must be 'chunked', 'off' or None; got 'fused'"]
    assert any("with packed_cache=False: the chunked loss runs in the hook's forward step" in r
               for r in core.refusals(plain, core.HookRequest(linear_cross_entropy="chunked",
                                                               packed_cache=False)))
