"""Answer a prompt with a fine-tuned model: the merged export, or the base checkpoint + its PEFT
adapter (``export.merged_dir`` / ``export.adapter_dir`` of the main job).

    python -m megatron_fastpath.generate model.path=<hf dir> [adapter=<peft dir>] prompt="..." \\
        [max_new_tokens=64] [chat_template=true] [temperature=0] [seed=0] [device=auto]

The exported folders are Hugging Face / PEFT files, so this runs on transformers + peft (the
reference that serves them; not needed to train): ``AutoModelForCausalLM.from_pretrained``
(``dtype="auto"``: the checkpoint's), ``PeftModel.from_pretrained`` for the adapter, then
``model.generate``: greedy (``do_sample=False``) unless ``temperature`` > 0; it stops at the
checkpoint's generation config's end-of-sequence token(s) or after ``max_new_tokens``. The
prompt is one user message rendered by the tokenizer's chat template with the generation
prompt added when the tokenizer has a template (``chat_template=false``: the plain text,
tokenized with the tokenizer's special tokens). The tokenizer is the adapter folder's when it
has one (the export copies it there), else model.path's. Prints the answer (special tokens
dropped). ``device=auto``: CUDA when there is one, else the CPU.

Bad input is one ``error: ...`` line on stderr and exit 2, raised before any model is loaded:
a missing / unknown key, a folder that is not a checkpoint or an adapter, an adapter whose
modules or shapes do not fit model.path (checked on a weightless copy of the model).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, fields
from typing import Optional

__all__ = ["GenerateArgs", "GenerateError", "parse_args", "check_adapter", "prompt_ids", "generate", "main"]

USER_ERROR_EXIT_CODE = 2
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class GenerateError(ValueError):
    """Bad input: printed as one ``error: ...`` line, exit 2."""


@dataclass(frozen=True)
class GenerateArgs:
    model_path: str
    prompt: str
    adapter: Optional[str] = None
    max_new_tokens: int = 64
    chat_template: bool = True
    temperature: float = 0.0
    seed: int = 0
    device: str = "auto"


KEYS = {"model.path": "model_path", **{f.name: f.name for f in fields(GenerateArgs)
                                       if f.name != "model_path"}}
USAGE = ('usage: python -m megatron_fastpath.generate model.path=<hf dir> [adapter=<peft dir>] '
         'prompt="..." [max_new_tokens=64] [chat_template=true|false] [temperature=0] [seed=0] '
         '[device=auto|cpu|cuda]')


def _convert(key: str, value: str, kind):
    if kind is bool:
        if value.lower() not in ("true", "false"):
            raise GenerateError(f"{key}={value!r}: expected true or false")
        return value.lower() == "true"
    if kind in (int, float):
        try:
            number = kind(value)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise GenerateError(f"{key}={value!r}: expected {what}") from None
        least = 1 if key == "max_new_tokens" else 0
        if number < least:
            sign = "positive" if least else "non-negative"
            raise GenerateError(f"{key}={value!r}: expected a {sign} number")
        return number
    return value


def parse_args(argv) -> GenerateArgs:
    """``key=value`` arguments -> :class:`GenerateArgs`; checks the folders (reads no weights)."""
    kinds = {"max_new_tokens": int, "chat_template": bool, "temperature": float, "seed": int}
    given = {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key not in KEYS:
            raise GenerateError(f"{arg!r} is not a setting of generate: its keys are "
                                f"{', '.join(KEYS)} (key=value)")
        given[KEYS[key]] = _convert(key, value, kinds.get(KEYS[key], str))
    adapter = given.get("adapter")
    if adapter is not None:
        _check_dir("adapter", adapter, "adapter_config.json",
                   "point adapter at the folder export.adapter_dir wrote")
    if "model_path" not in given:
        base = _adapter_base(adapter) if adapter else None
        hint = f" (the adapter was trained from {base})" if base else ""
        raise GenerateError(f"model.path is required: the Hugging Face checkpoint folder to answer "
                            f"with{hint}; add model.path=<dir>")
    if os.path.isfile(os.path.join(given["model_path"], "adapter_config.json")):
        raise GenerateError(f"model.path={given['model_path']!r} is a PEFT adapter folder, not a "
                            "checkpoint: pass its base model as model.path and this folder as "
                            "adapter=")
    _check_dir("model.path", given["model_path"], "config.json", "point model.path at a Hugging "
               "Face checkpoint folder (export.merged_dir or the base)")
    if "prompt" not in given:
        raise GenerateError('prompt is required: add prompt="..."')
    device = given.get("device", "auto")
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise GenerateError(f"device={given['device']!r}: expected auto, cpu, cuda or cuda:<index>")
    return GenerateArgs(**given)


def _check_dir(key: str, path: str, marker: str, fix: str) -> None:
    if not os.path.isdir(path):
        raise GenerateError(f"{key}={path!r} is not a directory: {fix}")
    if not os.path.isfile(os.path.join(path, marker)):
        raise GenerateError(f"{key}={path!r} has no {marker}: {fix}")


def _adapter_base(adapter: str) -> Optional[str]:
    try:
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            return json.load(f).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None


def _require_hf():
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise GenerateError(f"generate runs on transformers + peft, which could not be imported "
                            f"({exc}): pip install transformers peft") from None


def check_adapter(args: GenerateArgs) -> None:
    """Every LoRA tensor of the adapter names a linear of model.path's model with the matching
    input / output size, checked on a weightless (meta-device) copy of the model."""
    import torch
    import transformers
    from safetensors import safe_open

    weights = os.path.join(args.adapter, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        raise GenerateError(f"adapter={args.adapter!r} has no adapter_model.safetensors: point "
                            "adapter at the folder export.adapter_dir wrote")
    config = transformers.AutoConfig.from_pretrained(args.model_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    modules = dict(model.named_modules())
    with safe_open(weights, framework="pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    fix = ("pass the checkpoint it was trained from as model.path (adapter_config.json names "
           f"{_adapter_base(args.adapter)})")
    misfit = f"adapter={args.adapter!r} does not fit model.path={args.model_path!r}"
    for key, shape in sorted(shapes.items()):
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
        if m is None:
            continue
        name, which = m.groups()
        mod = modules.get(name)
        if not isinstance(mod, torch.nn.Linear):
            raise GenerateError(f"{misfit}: its tensor {key} adapts {name}, which the model "
                                f"lacks; {fix}")
        want, got = (mod.in_features, shape[1]) if which == "A" else (mod.out_features, shape[0])
        if want != got:
            side = "input" if which == "A" else "output"
            raise GenerateError(f"{misfit}: {key} has shape {list(shape)}, {name} has {side} "
                                f"size {want}; {fix}")


def _tokenizer_dir(args: GenerateArgs) -> str:
    if args.adapter and any(os.path.isfile(os.path.join(args.adapter, name))
                            for name in TOKENIZER_MARKERS):
        return args.adapter
    return args.model_path


def prompt_ids(tokenizer, args: GenerateArgs) -> list:
    """The prompt's token ids: the chat template's rendering of one user message with the
    generation prompt (when the tokenizer has a template and chat_template is on), else the text."""
    if args.chat_template and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(args.prompt)["input_ids"]


def generate(args: GenerateArgs):
    """``(new token ids, answer text)`` for ``args`` (see the module docstring)."""
    import torch
    import transformers

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise GenerateError(f"device={device}: torch sees no CUDA device here; use device=cpu "
                            "(or auto)")
    if args.adapter:
        check_adapter(args)
    tokenizer = transformers.AutoTokenizer.from_pretrained(_tokenizer_dir(args))
    ids = prompt_ids(tokenizer, args)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_path, dtype="auto")
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    model = model.to(device).eval()
    input_ids = torch.tensor([ids], device=device)
    sampling = {"do_sample": False}
    if args.temperature > 0:
        sampling = {"do_sample": True, "temperature": args.temperature}
    torch.manual_seed(args.seed)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=args.max_new_tokens, **sampling)
    new = out[0, input_ids.shape[1]:].tolist()
    return new, tokenizer.decode(new, skip_special_tokens=True)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return
    try:
        args = parse_args(argv)
        _require_hf()
        _, text = generate(args)
    except GenerateError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT_CODE)
    print(text, flush=True)


if __name__ == "__main__":
    main()
