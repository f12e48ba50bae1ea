"""NeMo 2's ``llm.finetune`` with ``apply_fastpath`` for a few steps on a GPU.

On this CPU machine NeMo trains only under test-only stand-ins (``torch.cuda.Stream`` in
``nemo/lightning/megatron_parallel.py`` and the rest: ``tests/support/nemo_on_cpu.py``), which
``tests/integrations/test_nemo_finetune_cpu.py`` uses to compare three LoRA steps with the main
job's losses. This test is ``gpu``-marked: the first GPU user runs the real NeMo path once (TE,
bf16, NCCL, no stand-ins) -- the tiny Llama
checkpoint of ``examples/make_tiny_hf_llama.py`` imported with ``llm.import_ckpt`` (HF ->
NeMo), the shipped chat JSONL converted to NeMo's input/output fine-tuning format, a LoRA
recipe with packed sequences, ``apply_fastpath``, three steps. Not run on this CPU machine.
"""

import json
import os

import pytest

pytestmark = pytest.mark.nemo  # CI's legacy target (Python 3.11) runs these: NeMo 2.7 installs there only

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 256


def write_nemo_data(src: str, root: str) -> None:
    """NeMo's FineTuningDataModule files ({"input", "output"} per line) from chat records."""
    os.makedirs(root, exist_ok=True)
    rows = []
    for line in open(src, encoding="utf-8"):
        rec = json.loads(line)
        msgs = rec.get("messages")
        if msgs:
            user = [m["content"] for m in msgs if m["role"] == "user"][0]
            answer = [m["content"] for m in msgs if m["role"] == "assistant"][0]
            rows.append({"input": user, "output": answer})
    for name, part in (("training", rows[:-40]), ("validation", rows[-40:-20]), ("test", rows[-20:])):
        with open(os.path.join(root, f"{name}.jsonl"), "w") as f:
            for r in part:
                f.write(json.dumps(r) + "\n")


@pytest.mark.gpu
def test_nemo_finetune_with_fastpath_runs_a_few_steps(tmp_path):
    pytest.importorskip("nemo.collections.llm")
    import nemo_run as run
    from nemo import lightning as nl
    from nemo.collections import llm

    from megatron_fastpath.integrations.nemo import apply_fastpath
    import make_tiny_hf_llama

    hf_dir, nemo_dir = str(tmp_path / "hf"), str(tmp_path / "nemo_ckpt")
    make_tiny_hf_llama.main(hf_dir, os.path.join(REPO, "examples", "data", "arith_chat.jsonl"))
    config = llm.LlamaConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, seq_length=SEQ, rotary_base=10000.0, layernorm_epsilon=1e-5,
        share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=128)
    llm.import_ckpt(model=llm.LlamaModel(config), source=f"hf://{hf_dir}", output_path=nemo_dir)
    data_root = str(tmp_path / "data")
    write_nemo_data(os.path.join(REPO, "examples", "data", "arith_chat.jsonl"), data_root)

    recipe = llm.llama32_1b.finetune_recipe(dir=str(tmp_path / "run"), name="fastpath_tiny",
                                            num_nodes=1, num_gpus_per_node=1, peft_scheme="lora",
                                            packed_sequence=True, seq_length=SEQ)
    recipe.model = run.Config(llm.LlamaModel, config=run.Config(
        llm.LlamaConfig, num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, seq_length=SEQ, rotary_base=10000.0, layernorm_epsilon=1e-5,
        share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=128,
        cross_entropy_loss_fusion=False))
    recipe.data = run.Config(
        llm.FineTuningDataModule, dataset_root=data_root, seq_length=SEQ, micro_batch_size=1,
        global_batch_size=1, packed_sequence_specs=run.Config(
            llm.gpt.data.packed_sequence.PackedSequenceSpecs, packed_sequence_size=SEQ),
        dataset_kwargs={"pad_to_max_length": True})
    recipe.resume = run.Config(nl.AutoResume, restore_config=run.Config(nl.RestoreConfig, path=nemo_dir))
    recipe.trainer.max_steps = 3
    recipe.trainer.val_check_interval = 3
    recipe.trainer.limit_val_batches = 1
    recipe.trainer.strategy.tensor_model_parallel_size = 1
    recipe.log.ckpt.save_last = True
    recipe = apply_fastpath(recipe)
    run.run(recipe, direct=True)
    ckpts = [p for p, _, _ in os.walk(str(tmp_path / "run")) if "step=2" in p or "last" in p]
    assert ckpts, "llm.finetune finished without writing a checkpoint"
