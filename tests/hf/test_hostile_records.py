"""Hostile data records are bad records with their line, not the whole load's end: a
``messages`` that is an empty list or a string (also a Parquet column of strings), JSON nested
100,000 deep, and one record too large for ``data.max_tokens`` (refused before it is parsed or
tokenized, so its size costs a bounded read)."""

import json
import os
import resource

import pytest

pytest.importorskip("transformers")

from tests.hf.hf_reference import DATA  # noqa: E402

import make_tiny_hf_llama as tiny  # noqa: E402  (examples/, on pytest.ini's pythonpath)

from megatron_fastpath.hf.data import DataError, JsonlDataConfig, load_jsonl_splits  # noqa: E402

GOOD = {"messages": [{"role": "user", "content": "What is 3 + 4?"},
                     {"role": "assistant", "content": "3 + 4 = 7."}]}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    tiny.build_tokenizer(path, DATA)
    return path


def write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n")
    return str(path)


def load(tok, path, **kw):
    cfg = JsonlDataConfig(path=str(path), eval_fraction=0.0, cache=False, **kw)
    return load_jsonl_splits(cfg, tok, log=lambda m: None)


def error_of(tok, path, **kw):
    with pytest.raises(DataError) as e:
        load(tok, path, **kw)
    return str(e.value)


def test_messages_that_are_not_a_list_are_bad_records(tok, tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [GOOD, {"messages": []}, {"messages": "text"}, GOOD])
    msg = error_of(tok, path)
    assert "2 malformed record(s): line 2 ('messages' must be a non-empty list of messages), " \
           "line 3 ('messages' must be a non-empty list of messages)" in msg
    assert "[by reason: bad_fields=2]" in msg
    train, _, report = load(tok, path, bad_records="skip")
    assert len(train) == 2 and report["malformed"] == 2 and report["bad_records"] == {"bad_fields": 2}


def test_a_parquet_column_of_json_strings_is_bad_rows(tok, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("datasets")
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([{"messages": json.dumps(GOOD["messages"])}] * 3), path)
    msg = error_of(tok, path)
    assert f"3 malformed record(s): {path} row 0 ('messages' must be a non-empty list of messages)" in msg


def test_json_nested_100k_deep_is_one_bad_line(tok, tmp_path):
    deep = b"[" * 100_000 + b"]" * 100_000
    deep_obj = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = write_lines(tmp_path / "d.jsonl", [GOOD, deep, GOOD, deep_obj, GOOD])
    msg = error_of(tok, path)
    assert "2 malformed record(s): line 2 (invalid JSON (nested deeper than" in msg
    assert "line 4 (invalid JSON (nested deeper than" in msg and "[by reason: malformed_json=2]" in msg
    train, _, report = load(tok, path, bad_records="skip")
    assert len(train) == 3 and report["bad_records"] == {"malformed_json": 2}


def test_a_record_too_large_for_max_tokens_is_refused_before_tokenizing(tok, tmp_path, monkeypatch):
    """Its characters are counted before tokenizing (so the tokenizer never sees it), and a
    JSONL line beyond the line limit is not even held whole."""
    from megatron_fastpath.hf.data import CHARS_PER_TOKEN, line_byte_limit

    max_tokens = 64
    chars = max_tokens * CHARS_PER_TOKEN + 1
    big_text = {"messages": [{"role": "user", "content": "a" * chars}, {"role": "assistant", "content": "ok"}]}
    huge = line_byte_limit(max_tokens) + 10
    huge_line = b'{"text": "' + b"b" * huge + b'"}'
    path = write_lines(tmp_path / "d.jsonl", [GOOD, big_text, GOOD, huge_line, GOOD])
    import megatron_fastpath.hf.tokenizer as tokenizer_module

    seen = []
    real = tokenizer_module.ChatTokenizer.tokens_and_mask

    def spy(self, text, spans):
        seen.append(len(text))
        return real(self, text, spans)

    monkeypatch.setattr(tokenizer_module.ChatTokenizer, "tokens_and_mask", spy)
    msg = error_of(tok, path, max_tokens=max_tokens)
    assert max(seen) < 1000  # only the good records were tokenized
    assert (f"2 record(s) longer than data.max_tokens=64: line 2 ({chars + 2} characters, more than "
            f"data.max_tokens=64 tokens can hold (at most {chars - 1} characters, {CHARS_PER_TOKEN} a "
            f"token; not tokenized)), line 4 (a line of {len(huge_line)} bytes, more than "
            f"data.max_tokens=64 tokens can hold (at most {line_byte_limit(64)} bytes a line; not "
            "parsed))") in msg
    assert "malformed" not in msg and "[by reason: too_long=2]" in msg
    train, _, report = load(tok, path, max_tokens=max_tokens, bad_records="skip")
    assert len(train) == 3 and report["too_long"] == 2 and report["malformed"] == 0
    assert report["bad_records"] == {"too_long": 2}


def test_a_100_mb_record_costs_a_bounded_read(tok, tmp_path):
    """A 100 MB line under data.max_tokens=512: refused as too long, the job's memory grows by
    far less than the line (it is read past in chunks, never parsed or tokenized)."""
    path = tmp_path / "d.jsonl"
    with open(path, "wb") as f:
        f.write(json.dumps(GOOD).encode() + b"\n")
        f.write(b'{"messages": [{"role": "user", "content": "')
        chunk = b"word " * (1 << 20)
        for _ in range(20):
            f.write(chunk)
        f.write(b'"}, {"role": "assistant", "content": "ok"}]}\n')
        f.write(json.dumps(GOOD).encode() + b"\n")
    assert os.path.getsize(path) > 100 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    train, _, report = load(tok, path, bad_records="skip")
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert len(train) == 2 and report["bad_records"] == {"too_long": 1}
    assert grew_mib < 50, grew_mib
