"""The exported PEFT adapter folder carries the checkpoint's tokenizer files and chat template,
as the merged folder does: transformers' AutoTokenizer loads it and tokenizes as the base's."""

import filecmp
import os

import pytest

transformers = pytest.importorskip("transformers")

TEXTS = ["What is 12 + 30?", "  spaces,\ttabs and <|eot_id|> specials\n", "ünïcödé 42"]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_the_adapter_folder_loads_as_the_base_tokenizer(tiny, tiny_export):
    adapter_dir = tiny_export["adapter"]
    for name in ("tokenizer.json", "tokenizer_config.json"):  # what the tiny checkpoint has
        assert filecmp.cmp(os.path.join(tiny, name), os.path.join(adapter_dir, name), shallow=False)
    base = transformers.AutoTokenizer.from_pretrained(tiny)
    tok = transformers.AutoTokenizer.from_pretrained(adapter_dir)
    for text in TEXTS:
        assert tok(text)["input_ids"] == base(text)["input_ids"]
    assert tok.chat_template == base.chat_template
    assert (tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
            == base.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True))
    assert tok.eos_token == base.eos_token == "<|eot_id|>"
