"""The main job with ``fastpath.linear_cross_entropy=chunked`` trains what it trains with ``off``
(Megatron's output layer and ``compute_language_model_loss``): per-step losses and final
parameters within float32 tolerance, on the default model, with LoRA (frozen output layer), on a
Hugging Face import with tied embeddings and its JSONL data (the held-out evaluation's loss and
token accuracy too: chunked logits there), and on the GPU path (run on the CPU inside the GPU
stand-ins: CUDA-as-CPU mode and the fake CUDA graph) with per-layer and with full-iteration
CUDA graphs -- captured and replayed, 0 host syncs in every step -- while the output layer's
forward never runs (no [T, V] logits). Each kind trains twice in this process (off, chunked)."""

from __future__ import annotations

import pytest
import torch

from tests.support.hydra_compose import compose_job, features_on
from tests.support.main_job import TINY_CHECKPOINT_OPTIMIZER, fresh_process_state, train_in_process
from tests.support.matrix_runs import params

pytestmark = pytest.mark.integration

STEPS = 4
BASE = [f"training.steps={STEPS}", "training.micro_batches=2", "data.max_tokens=128",
        "data.max_seqs=8", "training.warmup_steps=2",
        "training.sync_check=every", "training.skip_memory_check=true", "cluster.backend=gloo",
        "fastpath.linear_impl=local", "lora.dropout=0.0", "cuda_graphs.use_te_rng_tracker=false"]
# the synthetic model and data
SHAPE = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=96", "data.num_samples=64",
         "data.max_len=48"]
GPU = SHAPE + ["training.device=cuda", "fastpath.cuda_graphs=true"]
KINDS = {
    "default": SHAPE + ["training.device=cpu"],
    "lora": SHAPE + ["training.device=cpu", "fastpath.lora=true"],
    "hf_tied": ["training.device=cpu", "model=hf", *TINY_CHECKPOINT_OPTIMIZER, "data=jsonl",
                "data.eval_fraction=0.2", "data.eval_every=2"],
    "layer_graphs": GPU + ["cuda_graphs.scope=layers"],
    "full_iteration": GPU + ["cuda_graphs.scope=full_iteration"],
}


def _train(overrides: list, gpu: bool):
    """(summary, job, output-layer calls) of the main job in this process."""
    from unittest import mock

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from tests.support.main_job import train_in_standins

    calls = []
    real = ColumnParallelLinear.forward

    def counted(self, *args, **kwargs):
        if "runtime_gather_output" in kwargs:  # GPTModel's output-layer call only
            calls.append(self)
        return real(self, *args, **kwargs)

    with mock.patch.object(ColumnParallelLinear, "forward", counted):
        if gpu:
            summary, job = train_in_standins(compose_job(overrides))
        else:
            fresh_process_state()
            job, summary = train_in_process(overrides)
    return summary, job, len(calls)


def _tied_checkpoint(path: str) -> list:
    """A tiny Llama checkpoint with tied embeddings and the chat tokenizer of
    examples/make_tiny_hf_llama.py (trained on the shipped chat data): model / data overrides."""
    import make_tiny_hf_llama as tiny
    import transformers as tf

    from tests.hf.hf_reference import DATA

    tok = tiny.build_tokenizer(path, DATA)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=4, pad_token_id=5,
        initializer_range=0.1)).save_pretrained(path, safe_serialization=True)
    return [f"model.path={path}", f"data.path={DATA}"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_chunked_loss_trains_what_megatron_s_loss_trains(mcore_parallel, tmp_path_factory, kind):
    overrides = features_on(BASE + KINDS[kind])
    if kind == "hf_tied":
        overrides += _tied_checkpoint(str(tmp_path_factory.mktemp("tied")))
    gpu = "training.device=cuda" in overrides
    off, job_off, calls_off = _train(overrides + ["fastpath.linear_cross_entropy=off"], gpu)
    chunked, job_c, calls_c = _train(overrides + ["fastpath.linear_cross_entropy=chunked"], gpu)
    assert job_c.cfg.linear_cross_entropy == "chunked" and job_off.cfg.linear_cross_entropy == "off"
    assert calls_off > 0 and calls_c == 0  # the chunked runs never form the logits
    assert len(chunked.records) == len(off.records) == STEPS
    for c, o in zip(chunked.records, off.records):
        assert c.loss == pytest.approx(o.loss, rel=1e-5, abs=1e-6), (c.step, c.loss, o.loss)
    assert [r.syncs_step for r in chunked.records] == [0] * STEPS
    pc, po = params(job_c), params(job_off)
    assert pc.keys() == po.keys()
    for k in pc:
        torch.testing.assert_close(pc[k], po[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    if kind == "hf_tied":  # held-out loss and token accuracy at steps 0, 2, 4
        assert job_c.cfg.model_source.tie_embeddings and len(chunked.evals) == 3
        assert [s for s, _ in chunked.evals] == [s for s, _ in off.evals]
        assert [x for _, x in chunked.evals] == pytest.approx([x for _, x in off.evals], rel=1e-5)
        assert chunked.eval_accuracy == off.eval_accuracy
    if kind == "full_iteration":  # step 1 eager, then the two captured graphs replayed
        assert [r.graph_launches for r in chunked.records] == [0] + [2] * (STEPS - 1)
    if kind == "layer_graphs":
        from tests.support.megatron_graphs import graph_runners

        runners = graph_runners(job_c.model)
        assert runners and all(r.fwd_graph.captured and r.bwd_graph.captured and
                               r.fwd_graph.replays == (STEPS - 1) * 2 for r in runners)


def test_context_parallel_chunked_loss_equals_off(tmp_path):
    """At CP 2 (a torchrun world of 2, each rank its CP-local share of every packed batch and
    its labels) the chunked loss trains the losses of ``off``."""
    from tests.support.main_job import run_main_job

    common = features_on(BASE + SHAPE + ["training.device=cpu", "parallel.context_parallel_size=2"])
    losses = {}
    for value in ("off", "chunked"):
        run = run_main_job(common + [f"fastpath.linear_cross_entropy={value}"], tmp_path, nproc=2, name=value)
        losses[value] = [r["loss"] for r in run.summary["records"]]
    assert len(losses["off"]) == STEPS
    assert losses["chunked"] == pytest.approx(losses["off"], rel=1e-5)
