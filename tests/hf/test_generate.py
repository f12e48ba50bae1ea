"""``python -m megatron_fastpath.generate`` answers a prompt from the package's exports (base +
PEFT adapter, or the merged folder) token for token as transformers' ``model.generate`` on
``PeftModel.from_pretrained(base, adapter)`` / the merged model does, the prompt rendered by the
tokenizer's chat template (or plain with chat_template=false); bad input is one line, exit 2."""

import os
import shutil
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")

from tests.hf.hf_reference import REPO  # noqa: E402

from megatron_fastpath.generate import generate, main, parse_args  # noqa: E402

PROMPT = "What is 12 + 30?"
N = 12


def reference(model_dir, adapter=None, chat=True, **sampling):
    """transformers' (+ peft's) greedy answer: the new token ids."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                      add_generation_prompt=True, tokenize=True)
    else:
        ids = tok(PROMPT)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    x = torch.tensor([ids])
    torch.manual_seed(sampling.pop("seed", 0))
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=N,
                             **(sampling or {"do_sample": False}))
    return out[0, x.shape[1]:].tolist(), tok


def ours(*argv):
    return generate(parse_args([f"max_new_tokens={N}", f"prompt={PROMPT}", *argv]))


def test_base_plus_adapter_answers_as_peft(tiny, tiny_export):
    want, _ = reference(tiny, tiny_export["adapter"])
    got, text = ours(f"model.path={tiny}", f"adapter={tiny_export['adapter']}")
    assert got == want and len(got) > 0
    base_only, tok = reference(tiny)
    assert base_only != want  # the adapter is not a no-op
    assert text == tok.decode(want, skip_special_tokens=True)


def test_merged_folder_answers_as_transformers(tiny_export):
    want, _ = reference(tiny_export["merged"])
    assert ours(f"model.path={tiny_export['merged']}")[0] == want


def test_without_the_chat_template_the_prompt_is_plain_text(tiny, tiny_export):
    want, _ = reference(tiny, tiny_export["adapter"], chat=False)
    got, _ = ours(f"model.path={tiny}", f"adapter={tiny_export['adapter']}", "chat_template=false")
    assert got == want


def test_sampling_with_a_temperature_is_transformers_sampling_under_the_seed(tiny, tiny_export):
    want, _ = reference(tiny, tiny_export["adapter"], do_sample=True, temperature=1.5, seed=3)
    got, _ = ours(f"model.path={tiny}", f"adapter={tiny_export['adapter']}", "temperature=1.5",
                  "seed=3")
    assert got == want


def test_the_command_line_prints_the_answer(tiny, tiny_export, tmp_path):
    want, tok = reference(tiny, tiny_export["adapter"])
    env = dict(os.environ, PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, "-m", "megatron_fastpath.generate", f"model.path={tiny}",
                          f"adapter={tiny_export['adapter']}", f"prompt={PROMPT}",
                          f"max_new_tokens={N}"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == tok.decode(want, skip_special_tokens=True) + "\n"


def _error(capsys, *argv):
    """main()'s exit code and its stderr line."""
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return exit_.value.code, err.strip()


def test_a_missing_model_path_is_one_line_naming_the_adapters_base(tiny, tiny_export, tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, "-m", "megatron_fastpath.generate",
                          f"adapter={tiny_export['adapter']}", "prompt=hi"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == (f"error: model.path is required: the Hugging Face checkpoint folder to "
                          f"answer with (the adapter was trained from {os.path.abspath(tiny)}); "
                          "add model.path=<dir>\n")


def test_bad_arguments_are_one_line(tiny, tiny_export, tmp_path, capsys):
    adapter = tiny_export["adapter"]
    code, err = _error(capsys, f"model.path={tmp_path / 'none'}", "prompt=hi")
    assert code == 2 and err == (f"error: model.path='{tmp_path / 'none'}' is not a directory: point "
                                 "model.path at a Hugging Face checkpoint folder (export.merged_dir "
                                 "or the base)")
    code, err = _error(capsys, f"model.path={adapter}", "prompt=hi")
    assert code == 2 and "is a PEFT adapter folder, not a checkpoint" in err
    code, err = _error(capsys, f"model.path={tiny}")
    assert code == 2 and err == 'error: prompt is required: add prompt="..."'
    code, err = _error(capsys, f"model.path={tiny}", "prompt=hi", "max_tokens=3")
    assert code == 2 and err.startswith("error: 'max_tokens=3' is not a setting of generate: its "
                                        "keys are model.path, prompt, adapter, max_new_tokens")
    code, err = _error(capsys, f"model.path={tiny}", "prompt=hi", "max_new_tokens=0")
    assert code == 2 and err == "error: max_new_tokens='0': expected a positive number"
    if not torch.cuda.is_available():
        code, err = _error(capsys, f"model.path={tiny}", "prompt=hi", "device=cuda")
        assert code == 2 and err == ("error: device=cuda: torch sees no CUDA device here; use "
                                     "device=cpu (or auto)")
    code, err = _error(capsys, f"model.path={tiny}", "prompt=hi", f"adapter={tiny}")
    assert code == 2 and err.endswith("has no adapter_config.json: point adapter at the folder "
                                      "export.adapter_dir wrote")


def test_an_adapter_of_another_model_is_one_line(tiny, tiny_export, tmp_path, capsys):
    import make_tiny_hf_llama
    from safetensors.torch import load_file, save_file

    adapter = tiny_export["adapter"]
    narrow = str(tmp_path / "narrow")  # the tiny Llama at hidden size 32 (the adapter's: 64)
    shutil.copytree(tiny, narrow)
    vocab = transformers.AutoConfig.from_pretrained(tiny).vocab_size
    make_tiny_hf_llama.build_model(narrow, vocab, hidden_size=32, intermediate_size=64)
    code, err = _error(capsys, f"model.path={narrow}", f"adapter={adapter}", "prompt=hi")
    assert code == 2 and err == (
        f"error: adapter={adapter!r} does not fit model.path={narrow!r}: base_model.model.model."
        "layers.0.mlp.down_proj.lora_A.weight has shape [4, 128], model.layers.0.mlp.down_proj has "
        f"input size 64; pass the checkpoint it was trained from as model.path (adapter_config.json "
        f"names {os.path.abspath(tiny)})")
    deeper = tmp_path / "deeper"  # an adapter of a deeper model: layer 2 of a 2-layer model
    shutil.copytree(adapter, deeper)
    tensors = load_file(deeper / "adapter_model.safetensors")
    tensors = {k.replace("layers.1.", "layers.2."): v for k, v in tensors.items()}
    save_file(tensors, deeper / "adapter_model.safetensors")
    code, err = _error(capsys, f"model.path={tiny}", f"adapter={deeper}", "prompt=hi")
    assert code == 2 and err.startswith(
        f"error: adapter={str(deeper)!r} does not fit model.path={tiny!r}: its tensor "
        "base_model.model.model.layers.2.mlp.down_proj.lora_A.weight adapts "
        "model.layers.2.mlp.down_proj, which the model lacks; pass the checkpoint")
