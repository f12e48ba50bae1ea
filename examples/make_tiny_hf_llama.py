"""Build a tiny Llama-architecture Hugging Face checkpoint and tokenizer locally (no download).

    python examples/make_tiny_hf_llama.py /tmp/tiny-llama [examples/data/arith_chat.jsonl]

Writes config.json + model.safetensors (random weights, transformers' init), a byte-level BPE
tokenizer trained on the JSONL's text (tokenizer.json, via the `tokenizers` library) and a
tokenizer_config.json with a Llama-3-style chat template (with {% generation %} tags) -- the
files a real checkpoint has. Needs transformers + tokenizers (the package's [hf] extra).
"""

from __future__ import annotations

import json
import os
import sys

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def corpus(jsonl: str):
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            for m in rec.get("messages", []):
                yield m["content"]
            for k in ("prompt", "completion"):
                if k in rec:
                    yield rec[k]


def build_tokenizer(out_dir: str, jsonl: str, vocab_size: int = 384, template: str = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(jsonl), trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", "pad_token": "<|pad|>", "model_max_length": 1024,
              "clean_up_tokenization_spaces": False, "chat_template": template}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return tok


def build_model(out_dir: str, vocab_size: int, seed: int = 0, **shape):
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.get("hidden_size", 64),
        intermediate_size=shape.get("intermediate_size", 128),
        num_hidden_layers=shape.get("num_hidden_layers", 2), num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=4, pad_token_id=5,
        initializer_range=0.1, torch_dtype="float32")
    model = tf.LlamaForCausalLM(cfg)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def main(out_dir: str, jsonl: str = "examples/data/arith_chat.jsonl") -> None:
    tok = build_tokenizer(out_dir, jsonl)
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    assert ids["<|begin_of_text|>"] == 0 and ids["<|eot_id|>"] == 4 and ids["<|pad|>"] == 5, ids
    build_model(out_dir, tok.get_vocab_size())
    print(f"wrote a tiny Llama checkpoint ({tok.get_vocab_size()} tokens) to {out_dir}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
