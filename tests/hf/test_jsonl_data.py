"""data=jsonl: token ids and assistant masks equal transformers' apply_chat_template; bad lines
and over-long records are counted with line numbers; packing, held-out split and cache."""

import json
import os

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
import make_tiny_hf_llama as tiny  # noqa: E402

from megatron_fastpath.hf.data import DataError, JsonlDataConfig, load_jsonl_splits  # noqa: E402
from megatron_fastpath.hf.tokenizer import ChatTokenizer, TokenizerError  # noqa: E402

DATA = os.path.join(EXAMPLES, "data", "arith_chat.jsonl")
CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "3 + 4 = 7."}],
    [{"role": "system", "content": "You are a careful calculator."},
     {"role": "user", "content": "Compute 12 * 3."}, {"role": "assistant", "content": "12 * 3 = 36."},
     {"role": "user", "content": "And plus 4?"}, {"role": "assistant", "content": "36 + 4 = 40."}],
    [{"role": "user", "content": "Convert 2 km to m."}, {"role": "assistant", "content": " 2 km = 2000 m. "},
     {"role": "user", "content": "Thanks"}],  # conversation ending on a user turn
]
NO_TAGS = tiny.CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    tagged = str(tmp_path_factory.mktemp("tagged"))
    plain = str(tmp_path_factory.mktemp("plain"))
    tiny.build_tokenizer(tagged, DATA)
    tiny.build_tokenizer(plain, DATA, template=NO_TAGS)
    return tagged, plain


def hf_reference(path, messages):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    return out["input_ids"], out["assistant_masks"]


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_chat_ids_and_masks_equal_transformers(tok_dirs, k):
    tagged, plain = tok_dirs
    msgs = CONVERSATIONS[k]
    want_ids, want_mask = hf_reference(tagged, msgs)
    assert sum(want_mask) > 0
    ids, mask = ChatTokenizer(tagged).encode_chat(msgs)
    assert ids == want_ids and mask == want_mask
    # a template without {% generation %} tags: same ids from transformers, and our prefix-diff
    # spans equal transformers' mask of the tagged template (the same rendering)
    plain_ids = transformers.AutoTokenizer.from_pretrained(plain).apply_chat_template(msgs, tokenize=True)
    ids2, mask2 = ChatTokenizer(plain).encode_chat(msgs)
    assert ids2 == plain_ids == want_ids and mask2 == want_mask


def test_rendering_is_sandboxed(tmp_path):
    import jinja2

    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tiny.build_tokenizer(str(tmp_path), DATA, template=evil)
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTokenizer(str(tmp_path)).encode_chat(CONVERSATIONS[0])


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


def test_splits_pack_and_counts(tok_dirs, tmp_path):
    from megatron_fastpath.data import pack_microbatches

    tagged, _ = tok_dirs
    cfg = JsonlDataConfig(path=DATA, max_tokens=128, max_seqs=16, eval_fraction=0.1, cache=False)
    train, held, report = load_jsonl_splits(cfg, tagged, log=lambda m: None)
    assert report["records"] == 400 and report["malformed"] == 0 and report["too_long"] == 0
    assert len(train) + len(held) == 400 and len(held) == 40
    assert not set(train.lines) & set(held.lines)
    bins = pack_microbatches(train, cfg)
    assert sum(int(b.lengths.sum()) for b in bins) == int(train.lengths.sum())
    assert sum(b.num_loss_tokens for b in bins) == train.num_loss_tokens
    # the loss mask is the assistant mask shifted by one (position j predicts token j+1)
    tok = ChatTokenizer(tagged)
    line = train.lines[0]
    rec = json.loads(open(DATA).readlines()[line - 1])
    if "messages" in rec:
        ids, mask = tok.encode_chat(rec["messages"])
        tokens, loss = train.samples[0]
        assert tokens.tolist() == ids and loss[:-1].tolist() == mask[1:] and loss[-1] == 0


def test_bad_lines_reported_with_line_numbers(tok_dirs, tmp_path):
    tagged, _ = tok_dirs
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1 + 1 = 2."}]}
    long = {"messages": [{"role": "user", "content": "1 " * 300}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, "{not json", {"text": "x"}, good, long, good,
                                              {"messages": [{"role": "user"}]}, good])
    cfg = JsonlDataConfig(path=path, max_tokens=64, eval_fraction=0.0, cache=False)
    with pytest.raises(DataError) as e:
        load_jsonl_splits(cfg, tagged, log=lambda m: None)
    msg = str(e.value)
    assert path in msg and "3 malformed record(s)" in msg and "1 record(s) longer than" in msg
    assert "line 2 (invalid JSON" in msg and "line 3 (a text record in a conversational file" in msg
    assert "line 7 (messages[0] needs string 'role' and 'content')" in msg and "line 5 (" in msg
    logs = []
    cfg = JsonlDataConfig(path=path, max_tokens=64, eval_fraction=0.0, cache=False, bad_records="skip")
    train, held, report = load_jsonl_splits(cfg, tagged, log=logs.append)
    assert len(train) == 4 and held is None and report["malformed"] == 3 and report["too_long"] == 1
    assert any("skipped" in m and "line 2" in m for m in logs)


def test_chat_data_needs_a_template(tmp_path):
    tiny.build_tokenizer(str(tmp_path), DATA, template=None)
    cfg_file = tmp_path / "tokenizer_config.json"
    cfg = json.load(open(cfg_file))
    cfg.pop("chat_template")
    json.dump(cfg, open(cfg_file, "w"))
    with pytest.raises(TokenizerError, match="tokenizer_config.json has no 'chat_template'"):
        load_jsonl_splits(JsonlDataConfig(path=DATA, cache=False), str(tmp_path), log=lambda m: None)


def test_prompt_completion_records(tok_dirs, tmp_path):
    tagged, _ = tok_dirs
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: 2 + 2?\nA:", "completion": " 4."}] * 3)
    train, _, _ = load_jsonl_splits(JsonlDataConfig(path=path, eval_fraction=0.0, cache=False), tagged,
                                    log=lambda m: None)
    tok = ChatTokenizer(tagged)
    p = tok.tokenizer.encode("Q: 2 + 2?\nA:").ids
    c = tok.tokenizer.encode(" 4.", add_special_tokens=False).ids + [tok.eos_id]
    tokens, loss = train.samples[0]
    assert p[0] == tok.token_id("<|begin_of_text|>")
    assert tokens.tolist() == p + c
    assert loss.tolist() == [0.0] * (len(p) - 1) + [1.0] * len(c) + [0.0]


def test_tokenized_records_cached_in_the_cache_dir(tok_dirs, tmp_path):
    tagged, _ = tok_dirs
    path = str(tmp_path / "copy.jsonl")
    open(path, "w").write(open(DATA).read())
    cfg = JsonlDataConfig(path=path, max_tokens=128, cache=True, cache_dir=str(tmp_path / "cache"))
    logs = []
    first = load_jsonl_splits(cfg, tagged, log=logs.append)
    caches = os.listdir(tmp_path / "cache")
    assert len(caches) == 1 and caches[0].startswith("copy.jsonl.") and caches[0].endswith(".tokens.npz")
    assert sorted(os.listdir(tmp_path)) == ["cache", "copy.jsonl"]  # nothing beside the data
    assert any(f"cached in {tmp_path / 'cache' / caches[0]}" in m for m in logs)
    logs.clear()
    second = load_jsonl_splits(cfg, tagged, log=logs.append)
    assert any("from cache" in m for m in logs)
    for a, b in zip(first[0].samples, second[0].samples):
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    with open(path, "a") as f:  # changed data -> new cache key
        f.write(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    logs.clear()
    load_jsonl_splits(cfg, tagged, log=logs.append)
    assert any("cached in" in m for m in logs)


# A Qwen2.5-style template: whitespace control, default system prompt injected when none is
# given, tool branch with tojson, namespace-free loop with loop.last.
QWEN_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- if tools %}{{- '# Tools\\n' + (tools | tojson) + '\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}@@{{- message.content + '<|im_end|>' }}##{{- '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_qwen_style_template_without_tags(tmp_path, k):
    """Real-world template features; our prefix spans equal transformers' mask of the same
    template with {% generation %} tags around each assistant reply."""
    tagged, plain = str(tmp_path / "t"), str(tmp_path / "p")
    tiny.build_tokenizer(tagged, DATA, template=QWEN_LIKE.replace("@@", "{% generation %}").replace("##", "{% endgeneration %}"))
    tiny.build_tokenizer(plain, DATA, template=QWEN_LIKE.replace("@@", "").replace("##", ""))
    msgs = CONVERSATIONS[k]
    want_ids, want_mask = hf_reference(tagged, msgs)
    plain_ids = transformers.AutoTokenizer.from_pretrained(plain).apply_chat_template(msgs, tokenize=True)
    ids, mask = ChatTokenizer(plain).encode_chat(msgs)
    assert ids == plain_ids == want_ids and mask == want_mask and sum(mask) > 0


class _RunsOnLoad:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("planted", ["object-array", "not-a-zip", "inconsistent"])
def test_planted_token_cache_is_never_unpickled_and_is_rebuilt(tok_dirs, tmp_path, planted):
    """The token cache is a file in a shared cache directory: a planted one holding a pickled object
    array is read with allow_pickle=False (nothing runs), and any cache that is not one this
    module wrote is tokenized again -- the samples equal a fresh tokenization."""
    tagged, _ = tok_dirs
    path = str(tmp_path / "copy.jsonl")
    open(path, "w").write(open(DATA).read())
    cfg = JsonlDataConfig(path=path, max_tokens=128, cache=True, cache_dir=str(tmp_path / "cache"))
    fresh = load_jsonl_splits(JsonlDataConfig(path=path, max_tokens=128, cache=False), tagged, log=lambda m: None)
    load_jsonl_splits(cfg, tagged, log=lambda m: None)
    (cache,) = [tmp_path / "cache" / f for f in os.listdir(tmp_path / "cache") if f.endswith(".tokens.npz")]
    marker = tmp_path / "ran"
    with np.load(cache) as z:
        arrays = dict(z)
    if planted == "object-array":
        arrays["ids"] = np.array([_RunsOnLoad(marker)], dtype=object)
        np.savez(cache, **arrays)  # np.savez pickles object arrays
        with np.load(cache, allow_pickle=True) as z:  # the payload is live ...
            z["ids"]
        assert marker.exists()
        marker.unlink()  # ... and must not run again below
    elif planted == "not-a-zip":
        cache.write_bytes(b"\x80\x04garbage")
    else:
        arrays["lengths"] = arrays["lengths"] + 1
        np.savez(cache, **arrays)
    logs = []
    again = load_jsonl_splits(cfg, tagged, log=logs.append)
    assert not marker.exists()
    assert any("is not a" in m and "tokenizing again" in m for m in logs), logs
    for a, b in zip(fresh[0].samples, again[0].samples, strict=True):
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


# --------------------------------------------------------------------------- formats
def _records(tagged, tmp_path, records, **cfg):
    path = write_jsonl(tmp_path / "f.jsonl", records)
    return load_jsonl_splits(JsonlDataConfig(path=path, eval_fraction=0.0, cache=False, **cfg), tagged,
                             log=lambda m: None)


@pytest.mark.parametrize("record", [
    {"conversations": [{"from": "human", "value": "What is 3 + 4?"}, {"from": "gpt", "value": "3 + 4 = 7."}]},
    {"instruction": "What is 3 + 4?", "output": "3 + 4 = 7."},
    {"prompt": [{"role": "user", "content": "What is 3 + 4?"}],
     "completion": [{"role": "assistant", "content": "3 + 4 = 7."}]},
], ids=["sharegpt", "alpaca", "prompt_completion_messages"])
def test_chat_formats_equal_transformers_on_the_same_messages(tok_dirs, tmp_path, record):
    """ShareGPT, Alpaca and conversational prompt-completion records train exactly what their
    messages give under transformers' apply_chat_template (ids and assistant mask)."""
    tagged, _ = tok_dirs
    train, _, _ = _records(tagged, tmp_path, [record] * 2)
    ids, mask = hf_reference(tagged, CONVERSATIONS[0])
    tokens, loss = train.samples[0]
    assert tokens.tolist() == ids
    assert loss.tolist() == [float(x) for x in mask[1:]] + [0.0]  # loss on the next token


def test_text_records_train_every_token(tok_dirs, tmp_path):
    tagged, _ = tok_dirs
    text = "12 * 3 = 36. Then 36 + 4 = 40."
    train, _, _ = _records(tagged, tmp_path, [{"text": text}] * 2)
    ref = transformers.AutoTokenizer.from_pretrained(tagged)
    want = ref(text)["input_ids"] + [ref.eos_token_id]
    tokens, loss = train.samples[0]
    assert tokens.tolist() == want and loss.tolist() == [1.0] * (len(want) - 1) + [0.0]
    # forced: a chat record in a text file is refused, not silently trained as text
    with pytest.raises(DataError, match=r"line 2 \(a messages record in a text file"):
        _records(tagged, tmp_path, [{"text": text}, {"messages": CONVERSATIONS[0]}])
    with pytest.raises(DataError, match=r"line 1 \('text' must be a non-empty string"):
        _records(tagged, tmp_path, [{"messages": CONVERSATIONS[0]}], format="text")


def test_bad_records_of_every_kind_reported_with_lines(tok_dirs, tmp_path):
    """Invalid UTF-8 is one bad line (it raised a bare UnicodeDecodeError for the whole file),
    a misspelled role is refused (it trained as context), an alpaca record with a non-string
    input and an unknown ShareGPT speaker are named."""
    tagged, _ = tok_dirs
    good = json.dumps({"messages": CONVERSATIONS[0]}).encode()
    bad_role = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                        {"role": "assistent", "content": "x"}]}).encode()
    bad_speaker = json.dumps({"conversations": [{"from": "narrator", "value": "x"}]}).encode()
    bad_alpaca = json.dumps({"instruction": "x", "input": 3, "output": "y"}).encode()
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join([good, b'{"text": "\xff\xfe"}', bad_role, bad_speaker, bad_alpaca, good]) + b"\n")
    cfg = JsonlDataConfig(path=str(path), eval_fraction=0.0, cache=False)
    with pytest.raises(DataError) as e:
        load_jsonl_splits(cfg, tagged, log=lambda m: None)
    msg = str(e.value)
    assert "4 malformed record(s)" in msg and "line 2 (invalid UTF-8 at byte" in msg
    assert "line 3 (messages[1] has the unknown role 'assistent'" in msg
    assert "line 4 (conversations[0] has the unknown speaker 'narrator'" in msg
    assert "line 5 (alpaca records need string 'instruction' and 'output'" in msg
    train, _, report = load_jsonl_splits(dataclasses_replace(cfg, bad_records="skip"), tagged, log=lambda m: None)
    assert len(train) == 2 and report["malformed"] == 4


def test_data_format_is_checked(tmp_path):
    with pytest.raises(DataError, match="data.format must be one of auto, messages"):
        JsonlDataConfig(path="x.jsonl", format="chatml")


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


# --------------------------------------------------------------------------- data that gives nothing
def test_records_of_no_known_format_are_refused_once_naming_their_keys(tok_dirs, tmp_path):
    """A file of {"question", "answer"} records: one short line naming the keys found, the
    formats read and how to map them (not one reason per record, nor data.max_tokens /
    bad_records=skip, which cannot help); no token cache is written for it."""
    tagged, _ = tok_dirs
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": f"{k} + 1?", "answer": f"{k + 1}"} for k in range(12)])
    for bad_records in ("error", "skip"):
        logs = []
        cfg = JsonlDataConfig(path=path, bad_records=bad_records)
        with pytest.raises(DataError) as e:
            load_jsonl_splits(cfg, tagged, log=logs.append)
        assert str(e.value) == (
            f"{path}: none of its 12 records is in a format data=jsonl reads; the keys found: "
            "'question', 'answer' (12 records). A record needs 'messages' (chat: a list of "
            "{\"role\", \"content\"}), 'conversations' (ShareGPT: {\"from\", \"value\"}), 'prompt' + "
            "'completion', 'instruction' + 'output' (Alpaca, optional 'input') or 'text' (plain "
            "text): map the keys onto these with data.columns, e.g. data.columns.prompt=question "
            "data.columns.completion=answer")
        assert logs == []  # nothing tokenized, nothing cached
    assert sorted(os.listdir(tmp_path)) == ["qa.jsonl"]


def test_an_empty_data_file_is_refused_saying_it_is_empty(tok_dirs, tmp_path):
    tagged, _ = tok_dirs
    for name, text, what in (("empty.jsonl", "", "0 bytes"), ("blank.jsonl", "\n \n\n", "blank lines only")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(DataError) as e:
            load_jsonl_splits(JsonlDataConfig(path=str(path)), tagged, log=lambda m: None)
        assert str(e.value) == (f"data.path {str(path)!r} is empty ({what}): there are no records to "
                                "train on; point data.path at the data (JSONL: one JSON object a line)")
    assert sorted(os.listdir(tmp_path)) == ["blank.jsonl", "empty.jsonl"]  # no cache


def test_an_empty_assistant_reply_is_a_bad_record(tok_dirs, tmp_path):
    """``"content": ""`` would train only the template's end-of-turn token: a bad record
    (no_loss_token) under data.bad_records, named by its line; so is an empty completion."""
    tagged, _ = tok_dirs
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1 + 1 = 2."}]}
    empty = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    blank_turn = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                               {"role": "user", "content": "c"}, {"role": "assistant", "content": " "}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, empty, good, blank_turn, good])
    cfg = JsonlDataConfig(path=path, eval_fraction=0.0, cache=False)
    with pytest.raises(DataError) as e:
        load_jsonl_splits(cfg, tagged, log=lambda m: None)
    assert str(e.value) == (
        f"{path}: 2 malformed record(s): line 2 (an empty assistant reply (message 2 of the "
        "conversation): nothing to learn but the template's end-of-turn token), line 4 (an empty "
        "assistant reply (message 4 of the conversation): nothing to learn but the template's "
        "end-of-turn token) [by reason: no_loss_token=2]. Fix the records, or set "
        "data.bad_records=skip")
    logs = []
    train, held, report = load_jsonl_splits(JsonlDataConfig(path=path, eval_fraction=0.0, cache=False,
                                                            bad_records="skip"), tagged, log=logs.append)
    assert len(train) == 3 and held is None
    assert report["bad_records"] == {"no_loss_token": 2} and report["records"] == 5
    assert [m for m in logs if m.startswith("data: skipped")] == [
        f"data: skipped {path}: 2 malformed record(s): line 2 (an empty assistant reply (message 2 of "
        "the conversation): nothing to learn but the template's end-of-turn token), line 4 (an empty "
        "assistant reply (message 4 of the conversation): nothing to learn but the template's "
        "end-of-turn token) [by reason: no_loss_token=2]"]
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "1 + 1 =", "completion": " 2"},
                                             {"prompt": "2 + 2 =", "completion": ""}])
    with pytest.raises(DataError, match=r"line 2 \(an empty 'completion': nothing to learn but the EOS token\)"):
        load_jsonl_splits(JsonlDataConfig(path=pc, eval_fraction=0.0, cache=False), tagged, log=lambda m: None)


# --------------------------------------------------------------------------- data.columns
def test_columns_map_other_keys_before_the_format_is_detected(tok_dirs, tmp_path):
    """data.columns.prompt=question data.columns.completion=answer trains {"question", "answer"}
    records as the prompt-completion records they map onto (same ids and loss masks); the
    messages and text keys map the same way."""
    tagged, _ = tok_dirs
    qa = [{"id": k, "question": f"Q: {k} + 1?\nA:", "answer": f" {k + 1}."} for k in range(4)]
    pc = [{"id": k, "prompt": r["question"], "completion": r["answer"]} for k, r in enumerate(qa)]
    chat = [{"conversation": c} for c in CONVERSATIONS[:2]]
    text = [{"body": "1 + 1 = 2."}, {"body": "2 + 2 = 4."}]

    def tokens(records, name, **cfg):
        path = write_jsonl(tmp_path / name, records)
        train, _, _ = load_jsonl_splits(JsonlDataConfig(path=path, eval_fraction=0.0, cache=False, **cfg),
                                        tagged, log=lambda m: None)
        return [(t.tolist(), m.tolist()) for t, m in train.samples]

    want = tokens(pc, "pc.jsonl")
    assert len(want) == 4
    assert tokens(qa, "qa.jsonl", columns={"prompt": "question", "completion": "answer", "text": None}) == want
    assert tokens(chat, "chat.jsonl", columns={"messages": "conversation"}) == tokens(
        [{"messages": c} for c in CONVERSATIONS[:2]], "msgs.jsonl")
    assert tokens(text, "body.jsonl", columns={"text": "body"}) == tokens(
        [{"text": r["body"]} for r in text], "text.jsonl")


def test_an_unknown_column_is_refused_in_one_line():
    with pytest.raises(DataError) as e:
        JsonlDataConfig(path="x.jsonl", columns={"question": "q"})
    assert str(e.value) == (
        "data.columns.question: no such column; data.columns maps a record's keys onto messages, "
        "conversations, prompt, completion, instruction, input, output, text "
        "(e.g. data.columns.prompt=question)")
    with pytest.raises(DataError, match="maps one key onto several columns"):
        JsonlDataConfig(path="x.jsonl", columns={"prompt": "q", "text": "q"})


def test_columns_compose_from_the_command_line():
    from megatron_fastpath.train import parse_job_config
    from tests.support.hydra_compose import compose_job

    cfg = parse_job_config(compose_job(["training.steps=4", "data=jsonl", "data.path=chat.jsonl",
                                        "data.tokenizer_path=tok", "data.columns.prompt=question",
                                        "data.columns.completion=answer"]))
    assert cfg.data.columns == {"completion": "answer", "prompt": "question"}


def test_an_unknown_format_record_names_the_columns_to_map(tok_dirs, tmp_path):
    tagged, _ = tok_dirs
    good = {"messages": CONVERSATIONS[0]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, {"question": "1 + 1?", "answer": "2"}, good])
    with pytest.raises(DataError) as e:
        load_jsonl_splits(JsonlDataConfig(path=path, eval_fraction=0.0, cache=False), tagged,
                          log=lambda m: None)
    assert ("line 2 (no 'messages' key (nor 'conversations', string or message-list 'prompt' and "
            "'completion', 'instruction' and 'output', or 'text'; its keys: 'question', 'answer'; map "
            "them with data.columns.prompt=question data.columns.completion=answer)") in str(e.value)


# --------------------------------------------------------------------------- data.eval_path
def test_eval_path_holds_out_its_records_and_trains_all_of_data_path(tok_dirs, tmp_path):
    """data.eval_path: the held-out split is that file's records (any of data.path's formats:
    here prompt-completion beside chat training data), every record of data.path trains; its
    bad records are reported naming the eval file."""
    tagged, _ = tok_dirs
    train_path = write_jsonl(tmp_path / "train.jsonl", [{"messages": c} for c in CONVERSATIONS[:2]] * 3)
    pcs = [{"prompt": f"Q: {k} + 1?\nA:", "completion": f" {k + 1}."} for k in range(3)]
    eval_path = write_jsonl(tmp_path / "eval.jsonl", pcs)
    cfg = JsonlDataConfig(path=train_path, eval_path=eval_path, cache=False)
    assert cfg.eval_fraction == 0.0 and cfg.evaluates
    train, held, report = load_jsonl_splits(cfg, tagged, log=lambda m: None)
    alone, _, _ = load_jsonl_splits(JsonlDataConfig(path=train_path, eval_fraction=0.0, cache=False),
                                    tagged, log=lambda m: None)
    assert [t.tolist() for t, _ in train.samples] == [t.tolist() for t, _ in alone.samples]
    assert len(train) == 6 and report["records"] == 6 and report["train_records"] == 6
    tok = ChatTokenizer(tagged)
    assert [t.tolist() for t, _ in held.samples] == [
        list(tok.encode_prompt_completion(r["prompt"], r["completion"])[0]) for r in pcs]
    assert list(held.lines) == [1, 2, 3] and report["eval_records"] == 3 and report["eval_path_records"] == 3
    bad = write_jsonl(tmp_path / "bad.jsonl", pcs + ["{oops"])
    with pytest.raises(DataError, match=rf"^{bad}: 1 malformed record\(s\): line 4 \(invalid JSON"):
        load_jsonl_splits(JsonlDataConfig(path=train_path, eval_path=bad, cache=False), tagged,
                          log=lambda m: None)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"data.eval_path '.*empty.jsonl' is empty \(0 bytes\): there are "
                                        r"no records to hold out; point data.eval_path at the data"):
        load_jsonl_splits(JsonlDataConfig(path=train_path, eval_path=str(empty), cache=False), tagged,
                          log=lambda m: None)


def test_eval_path_with_eval_fraction_is_refused_in_one_line():
    with pytest.raises(DataError) as e:
        JsonlDataConfig(path="t.jsonl", eval_path="e.jsonl", eval_fraction=0.1)
    assert str(e.value) == ("data.eval_path='e.jsonl' and data.eval_fraction=0.1 both set: the held-out "
                            "records come either from a separate file or from a share of data.path; "
                            "drop one of them")
    assert JsonlDataConfig(path="t.jsonl").eval_fraction == 0.1  # the default share
    assert JsonlDataConfig(path="t.jsonl", eval_path="e.jsonl", eval_samples=2).eval_samples == 2


# --------------------------------------------------------------------------- data.overlong
def test_overlong_records_truncated_from_the_right(tok_dirs, tmp_path):
    """data.overlong=truncate: a record longer than data.max_tokens keeps its first max_tokens
    tokens (the prompt whole, the completion / last assistant reply cut) and drops the tokens
    after the last loss token left; one whose prompt alone fills max_tokens stays over-long
    (data.bad_records); the truncated records are counted in the report and the log."""
    tagged, _ = tok_dirs
    tok = ChatTokenizer(tagged)
    short = {"prompt": "1 + 1 =", "completion": " 2."}
    long_pc = {"prompt": "Count:", "completion": " 1" * 60}
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1 + 1 = 2."},
             {"role": "user", "content": "more " * 40}, {"role": "assistant", "content": "ok"}]
    huge_prompt = {"prompt": "7 " * 80, "completion": " 8."}
    path = write_jsonl(tmp_path / "d.jsonl", [short, long_pc, short])
    full_ids, full_mask = tok.encode_prompt_completion(long_pc["prompt"], long_pc["completion"])
    assert len(full_ids) > 32
    logs = []
    train, _, report = load_jsonl_splits(JsonlDataConfig(path=path, max_tokens=32, eval_fraction=0.0,
                                                         cache=False, overlong="truncate"),
                                         tagged, log=logs.append)
    assert report["truncated"] == 1 and report["too_long"] == 0 and len(train) == 3
    tokens, loss = train.samples[1]
    assert tokens.tolist() == list(full_ids[:32])
    assert loss[:-1].tolist() == [float(x) for x in full_mask[1:32]] and loss[-1] == 0
    assert [m for m in logs if m.startswith("data: truncated")] == [
        f"data: truncated 1 record(s) of {path} longer than data.max_tokens=32 from the right "
        f"(data.overlong=truncate): line 2 ({len(full_ids)} -> 32 tokens)"]
    # a conversation cut inside its second user turn: the first reply kept, the rest dropped
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": turns}, {"messages": CONVERSATIONS[0]}])
    ids, mask = tok.encode_chat(turns)
    first_reply_end = max(j for j in range(40) if mask[j]) + 1
    assert len(ids) > 40 and not any(mask[first_reply_end:40])
    train, _, report = load_jsonl_splits(JsonlDataConfig(path=chat, max_tokens=40, eval_fraction=0.0,
                                                         cache=False, overlong="truncate"),
                                         tagged, log=lambda m: None)
    assert train.samples[0][0].tolist() == list(ids[:first_reply_end]) and report["truncated"] == 1
    # a prompt longer than max_tokens: nothing left to train, so it is over-long as before
    bad = write_jsonl(tmp_path / "b.jsonl", [short, huge_prompt, short])
    with pytest.raises(DataError, match=r"1 record\(s\) longer than data.max_tokens=32: line 2 .*"
                                        r"Fix the records, raise data.max_tokens, or set data.bad_records=skip$"):
        load_jsonl_splits(JsonlDataConfig(path=bad, max_tokens=32, eval_fraction=0.0, cache=False,
                                          overlong="truncate"), tagged, log=lambda m: None)


def test_overlong_policy_apart_from_bad_records(tok_dirs, tmp_path):
    """data.overlong=skip drops over-long records while bad_records=error still refuses
    malformed ones, and overlong=error refuses over-long records under bad_records=skip; unset,
    over-long records follow data.bad_records (the default error names the truncate option)."""
    tagged, _ = tok_dirs
    short = {"prompt": "1 + 1 =", "completion": " 2."}
    long_pc = {"prompt": "Count:", "completion": " 1" * 60}
    path = write_jsonl(tmp_path / "d.jsonl", [short, long_pc, short])
    logs = []
    train, _, report = load_jsonl_splits(JsonlDataConfig(path=path, max_tokens=32, eval_fraction=0.0,
                                                         cache=False, overlong="skip"), tagged, log=logs.append)
    assert len(train) == 2 and report["too_long"] == 1 and report["truncated"] == 0
    assert any(m.startswith("data: skipped") for m in logs)
    with pytest.raises(DataError, match=r"Fix the records, raise data.max_tokens, set data.overlong=truncate, "
                                        r"or set data.bad_records=skip$"):
        load_jsonl_splits(JsonlDataConfig(path=path, max_tokens=32, eval_fraction=0.0, cache=False),
                          tagged, log=lambda m: None)
    with pytest.raises(DataError, match=r"set data.overlong=truncate, or set data.overlong=skip$"):
        load_jsonl_splits(JsonlDataConfig(path=path, max_tokens=32, eval_fraction=0.0, cache=False,
                                          overlong="error", bad_records="skip"), tagged, log=lambda m: None)
    with pytest.raises(DataError, match="data.overlong must be null"):
        JsonlDataConfig(path="x.jsonl", overlong="cut")


def test_the_default_cache_dir_is_xdg_cache_home(tok_dirs, tmp_path, monkeypatch):
    """Unset, data.cache_dir is $XDG_CACHE_HOME/megatron_fastpath/tokens (~/.cache/... without
    it): the cache is written there, not beside the data."""
    from megatron_fastpath.hf.data.cache import cache_dir

    tagged, _ = tok_dirs
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVERSATIONS[:2]] * 2)
    cfg = JsonlDataConfig(path=path, eval_fraction=0.0)
    assert cache_dir(cfg) == str(tmp_path / "xdg" / "megatron_fastpath" / "tokens")
    load_jsonl_splits(cfg, tagged, log=lambda m: None)
    assert len(os.listdir(tmp_path / "xdg" / "megatron_fastpath" / "tokens")) == 1
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl", "xdg"]
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir(cfg) == str(tmp_path / "home" / ".cache" / "megatron_fastpath" / "tokens")
