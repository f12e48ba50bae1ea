"""Chat templates that render earlier turns differently from the last one.

Qwen3's template drops the ``<think>`` reasoning of every assistant turn before the last user
message and keeps it on the last one, so a conversation's prefixes do not render as prefixes of
the whole. Such a conversation trains as one sample per assistant turn: sample k is the
conversation up to and including assistant turn k, rendered on its own, loss on turn k only.
Checked against transformers' ``apply_chat_template`` on a Qwen3-style template (written here,
no download) and a byte-level BPE tokenizer trained here."""

import json
import os

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
import make_tiny_hf_llama as tiny  # noqa: E402

from megatron_fastpath.hf.data import JsonlDataConfig, load_jsonl_splits, tokenize_jsonl  # noqa: E402
from megatron_fastpath.hf.tokenizer import ChatTokenizer, TokenizerError  # noqa: E402

DATA = os.path.join(EXAMPLES, "data", "arith_chat.jsonl")

# Qwen3's public chat template (tools left out): reasoning from `reasoning_content` or from a
# <think>...</think> block in the content; an assistant turn after the last user query keeps
# its think block (the last turn always does), earlier ones lose it.
QWEN3 = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

THREE_TURNS = [
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "Compute 12 * 3."},
    {"role": "assistant", "reasoning_content": "12 * 3: ten threes are 30, two more are 6.",
     "content": "12 * 3 = 36."},
    {"role": "user", "content": "And plus 4?"},
    {"role": "assistant", "content": "<think>\n36 + 4 is 40.\n</think>\n\n36 + 4 = 40."},
    {"role": "user", "content": "Thanks, and minus 1?"},
    {"role": "assistant", "reasoning_content": "40 - 1 = 39.", "content": "40 - 1 = 39."},
    {"role": "user", "content": "Bye"},  # ends on a user turn: no sample of its own
]
ONE_TURN = [{"role": "user", "content": "What is 3 + 4?"},
            {"role": "assistant", "reasoning_content": "3 + 4 = 7", "content": "3 + 4 = 7."}]
NO_THINK = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "7."},
            {"role": "user", "content": "And 5 + 5?"}, {"role": "assistant", "content": "10."}]


def build_qwen_tokenizer(out_dir, template=QWEN3):
    """A byte-level BPE tokenizer with Qwen's chat tokens (<think> / </think> added tokens,
    not special, as in Qwen3), trained on the example data: tiny.build_tokenizer's recipe."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(tiny.corpus(DATA), trainer=trainer)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 1024,
              "clean_up_tokenization_spaces": False, "chat_template": template}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_qwen_tokenizer(str(tmp_path_factory.mktemp("qwen3")))


def _assistant_ends(messages):
    return [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"]


def _last_turn_text(m):
    """The last assistant turn as Qwen3 renders it (think block kept), end-of-turn included."""
    content = m["content"]
    reasoning = ""
    if "reasoning_content" in m:
        reasoning = m["reasoning_content"]
    elif "</think>" in content:
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        content = content.split("</think>")[-1].lstrip("\n")
    return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n") + "<|im_end|>"


def test_the_template_rewrites_earlier_turns(qwen3):
    """The premise: transformers' full rendering drops the earlier think blocks, so the
    one-sample path (prefix spans) refuses this conversation."""
    ref = transformers.AutoTokenizer.from_pretrained(qwen3)
    full = ref.apply_chat_template(THREE_TURNS, tokenize=False)
    assert "ten threes" not in full and "36 + 4 is 40" not in full and full.count("<think>") == 0
    last = ref.apply_chat_template(THREE_TURNS[:7], tokenize=False)
    assert last.count("<think>") == 1 and "40 - 1 = 39.\n</think>" in last
    with pytest.raises(TokenizerError, match="rewrites earlier turns"):
        ChatTokenizer(qwen3).encode_chat(THREE_TURNS)


def test_one_sample_per_assistant_turn_equals_transformers(qwen3):
    """Sample k: ids = apply_chat_template(messages up to assistant turn k); its loss tokens
    decode to exactly turn k as rendered last (think block, reply, <|im_end|>), nothing else."""
    ref = transformers.AutoTokenizer.from_pretrained(qwen3)
    tok = ChatTokenizer(qwen3)
    samples = tok.encode_chat_samples(THREE_TURNS)
    ends = _assistant_ends(THREE_TURNS)
    assert len(samples) == len(ends) == 3
    for (ids, mask), upto in zip(samples, ends):
        want = ref.apply_chat_template(THREE_TURNS[:upto], tokenize=True)
        assert ids == want
        trained = [t for t, m in zip(ids, mask) if m]
        assert ref.decode(trained, skip_special_tokens=False) == _last_turn_text(THREE_TURNS[upto - 1])
        # one contiguous span: right after the generation prompt, up to the template's last "\n"
        prompt = ref.apply_chat_template(THREE_TURNS[:upto - 1], tokenize=True, add_generation_prompt=True)
        assert ids[:len(prompt)] == prompt
        assert mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt) - 1) + [0]
        assert ref.decode(ids[-1:]) == "\n"


def test_one_assistant_turn_is_one_sample_as_before(qwen3):
    tok = ChatTokenizer(qwen3)
    ref = transformers.AutoTokenizer.from_pretrained(qwen3)
    samples = tok.encode_chat_samples(ONE_TURN)
    assert samples == [tok.encode_chat(ONE_TURN)]  # the one-sample path, unchanged
    ids, mask = samples[0]
    assert ids == ref.apply_chat_template(ONE_TURN, tokenize=True)
    trained = [t for t, m in zip(ids, mask) if m]
    assert ref.decode(trained, skip_special_tokens=False) == _last_turn_text(ONE_TURN[1])
    # a user turn after it: the full rendering drops the think block; the sample ends at the
    # assistant turn, rendered as the last turn
    msgs = ONE_TURN + [{"role": "user", "content": "ok"}]
    assert "<think>" not in ref.apply_chat_template(msgs, tokenize=False)
    assert tok.encode_chat_samples(msgs) == samples


def test_no_reasoning_still_splits_under_qwen3(qwen3):
    """Qwen3 gives the last turn an empty think block even without reasoning, so every
    conversation with two assistant turns renders its first turn differently when last."""
    ref = transformers.AutoTokenizer.from_pretrained(qwen3)
    samples = ChatTokenizer(qwen3).encode_chat_samples(NO_THINK)
    assert len(samples) == 2
    for (ids, mask), upto in zip(samples, _assistant_ends(NO_THINK)):
        assert ids == ref.apply_chat_template(NO_THINK[:upto], tokenize=True)
        trained = [t for t, m in zip(ids, mask) if m]
        assert ref.decode(trained) == "<think>\n\n</think>\n\n" + NO_THINK[upto - 1]["content"] + "<|im_end|>"


def test_conversations_whose_prefixes_are_prefixes_stay_one_sample(tmp_path):
    """The Llama-style template of the other tests (with and without generation tags): one
    sample, exactly encode_chat's (the existing token counts)."""
    plain = str(tmp_path / "plain")
    tiny.build_tokenizer(plain, DATA, template=tiny.CHAT_TEMPLATE.replace("{% generation %}", "")
                         .replace("{% endgeneration %}", ""))
    tagged = str(tmp_path / "tagged")
    tiny.build_tokenizer(tagged, DATA)
    msgs = [{"role": m["role"], "content": m["content"]} for m in NO_THINK]
    for path in (plain, tagged):
        t = ChatTokenizer(path)
        assert t.encode_chat_samples(msgs) == [t.encode_chat(msgs)]


def test_a_template_rewriting_even_the_last_turn_is_refused(tmp_path):
    """A header counting the messages changes with every prefix: not even messages[:i+1]
    extends messages[:i] + generation prompt, so no span can be located: refused for the file."""
    rewrites = "{{ messages | length }} messages\n" + QWEN3
    path = build_qwen_tokenizer(str(tmp_path / "tok"), template=rewrites)
    with pytest.raises(TokenizerError, match="rewrites earlier turns"):
        ChatTokenizer(path).encode_chat_samples(ONE_TURN)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": ONE_TURN}) + "\n")
    with pytest.raises(TokenizerError, match="rewrites earlier turns"):
        load_jsonl_splits(JsonlDataConfig(path=str(data), eval_fraction=0.0, cache=False,
                                          bad_records="skip"), path, log=lambda m: None)


def test_data_file_splits_counts_and_keeps_a_conversation_in_one_split(qwen3, tmp_path):
    """Through the data path (the template in its bounded helper process): the split
    conversation's samples equal transformers', the report counts them (split_for_template),
    the log says so, the held-out split keeps a conversation's samples together, and the
    token cache gives back the same samples."""
    ref = transformers.AutoTokenizer.from_pretrained(qwen3)
    records = [{"messages": THREE_TURNS}, {"messages": ONE_TURN}, {"messages": NO_THINK},
               {"messages": THREE_TURNS[:5]}, {"messages": ONE_TURN}, {"messages": THREE_TURNS}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    got = tokenize_jsonl(str(path), ChatTokenizer(qwen3))
    assert got.lines == [1, 1, 1, 2, 3, 3, 4, 4, 5, 6, 6, 6] and got.split_for_template == 6
    assert got.wheres[:3] == ["line 1"] * 3
    want = [ref.apply_chat_template(r["messages"][:upto], tokenize=True)
            for r in records for upto in _assistant_ends(r["messages"])]
    assert [ids.tolist() for ids in got.ids] == want

    logs = []
    cfg = JsonlDataConfig(path=str(path), eval_fraction=0.34, cache=True, max_tokens=512)
    train, held, report = load_jsonl_splits(cfg, qwen3, log=logs.append)
    assert report["records"] == 6 and report["split_for_template"] == 6 and report["malformed"] == 0
    assert report["train_records"] + report["eval_records"] == 12 == len(train) + len(held)
    assert not set(train.lines) & set(held.lines) and len(set(held.lines)) == 2
    assert any("split_for_template=6" in m and "one sample per turn" in m for m in logs), logs
    again = load_jsonl_splits(cfg, qwen3, log=logs.append)
    assert any("from cache" in m for m in logs) and again[2] == report
    for a, b in zip(train.samples + held.samples, again[0].samples + again[1].samples, strict=True):
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    # each sample's loss covers its last turn only (samples of a record in turn order)
    turns = {}
    for ds in (train, held):
        for line, (tokens, loss) in zip(ds.lines, ds.samples):
            msgs = records[line - 1]["messages"]
            k = turns.get(line, 0)
            turns[line] = k + 1
            trained = tokens[1:][loss[:-1] > 0].tolist()  # loss[j]: position j predicts j + 1
            last = msgs[_assistant_ends(msgs)[k] - 1]
            assert ref.decode(trained, skip_special_tokens=False) == _last_turn_text(last)
    assert turns == {1: 3, 2: 1, 3: 2, 4: 2, 5: 1, 6: 3}
