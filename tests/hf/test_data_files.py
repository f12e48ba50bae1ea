"""data=jsonl beyond JSONL: a JSON array, Parquet, Arrow, a datasets
``save_to_disk`` directory and a directory of shards, read through ``datasets`` into the same
record -> format -> tokenization path, give the JSONL file's token ids and loss masks; bad rows
are reported with file and row; the token cache key covers every shard; every refused or dropped
record is counted by reason in the log and the main job's summary JSON."""

import json
import os
import shutil
import sys

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tests.hf.hf_reference import DATA  # noqa: E402
from tests.support.main_job import TINY_CHECKPOINT_OPTIMIZER, job_env, run_main_job  # noqa: E402

import make_tiny_hf_llama as tiny  # noqa: E402  (examples/, on pytest.ini's pythonpath)

from megatron_fastpath.hf.data import (  # noqa: E402
    DataError,
    JsonlDataConfig,
    load_jsonl_splits,
    resolve_source,
    tokenize_jsonl,
)
from megatron_fastpath.hf.tokenizer import ChatTokenizer  # noqa: E402

KINDS = ("json_array", "parquet", "arrow", "save_to_disk", "jsonl_shards", "parquet_shards")


def records_of(path=DATA):
    return [json.loads(line) for line in open(path) if line.strip()]


def full_rows(records):
    """Every row with every key (None where absent): the shared schema a table needs."""
    keys = sorted({k for r in records for k in r})
    return [{k: r.get(k) for k in keys} for r in records]


def build(kind: str, out, records=None) -> str:
    """``records`` (default: the shipped arith_chat.jsonl) written as ``kind`` under ``out``."""
    records = records_of() if records is None else records
    os.makedirs(out, exist_ok=True)
    table = pa.Table.from_pylist(full_rows(records))
    if kind == "json_array":
        path = os.path.join(out, "data.json")
        json.dump(records, open(path, "w"), indent=1)
    elif kind == "parquet":
        path = os.path.join(out, "data.parquet")
        pq.write_table(table, path)
    elif kind == "save_to_disk":
        path = os.path.join(out, "saved")
        datasets.Dataset(datasets.table.InMemoryTable(table)).save_to_disk(path)
    elif kind == "arrow":  # the Arrow file save_to_disk writes
        saved = build("save_to_disk", os.path.join(out, "tmp"), records)
        (name,) = [n for n in os.listdir(saved) if n.endswith(".arrow")]
        path = os.path.join(out, "data.arrow")
        shutil.copy(os.path.join(saved, name), path)
    elif kind in ("jsonl_shards", "parquet_shards"):
        path = os.path.join(out, "shards")
        os.makedirs(path)
        cuts = np.array_split(np.arange(len(records)), 4)
        for k, idx in enumerate(cuts):
            part = [records[i] for i in idx]
            if kind == "jsonl_shards":
                with open(os.path.join(path, f"part-{k:05d}.jsonl"), "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in part)
            else:  # each shard with the full schema (as a writer of shards would give)
                pq.write_table(pa.Table.from_pylist(full_rows(part)), os.path.join(path, f"part-{k:05d}.parquet"))
    else:
        raise ValueError(kind)
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    tiny.build_tokenizer(d, DATA)
    return d


@pytest.mark.parametrize("kind", KINDS)
def test_file_types_give_the_jsonl_records(tok_dir, tmp_path, kind):
    """Same token ids and assistant masks, in the same order, as the JSONL file."""
    tok = ChatTokenizer(tok_dir)
    want = tokenize_jsonl(DATA, tok)
    path = build(kind, tmp_path)
    source = resolve_source(path)
    assert source.kind == {"json_array": "json", "jsonl_shards": "jsonl", "parquet_shards": "parquet"}.get(kind, kind)
    got = tokenize_jsonl(path, tok)
    assert len(want.ids) == len(got.ids) == 400 and not got.malformed
    for a, b, ma, mb in zip(want.ids, got.ids, want.masks, got.masks, strict=True):
        assert np.array_equal(a, b) and np.array_equal(ma, mb)
    # and through the splits: the same train / held-out samples (tokens and loss masks)
    cfg = dict(max_tokens=128, eval_fraction=0.1, cache=False)
    w = load_jsonl_splits(JsonlDataConfig(path=DATA, **cfg), tok_dir, log=lambda m: None)
    g = load_jsonl_splits(JsonlDataConfig(path=path, **cfg), tok_dir, log=lambda m: None)
    assert w[2] == g[2]
    for split in (0, 1):
        for (ta, la), (tb, lb) in zip(w[split].samples, g[split].samples, strict=True):
            assert np.array_equal(ta, tb) and np.array_equal(la, lb)


def test_bad_rows_reported_with_file_and_row(tok_dir, tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1 + 1 = 2."}]}
    bad_role = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistent", "content": "2."}]}
    no_asst = {"messages": [{"role": "user", "content": "hi"}]}
    path = build("parquet", tmp_path, [good, bad_role, good, no_asst, good])
    cfg = JsonlDataConfig(path=path, eval_fraction=0.0, cache=False)
    with pytest.raises(DataError) as e:
        load_jsonl_splits(cfg, tok_dir, log=lambda m: None)
    msg = str(e.value)
    assert "2 malformed record(s)" in msg
    assert f"{path} row 1 (messages[1] has the unknown role 'assistent'" in msg
    assert f"{path} row 3 (no assistant message" in msg
    assert "[by reason: no_assistant=1, unknown_role=1]" in msg
    logs = []
    train, _, report = load_jsonl_splits(JsonlDataConfig(path=path, eval_fraction=0.0, cache=False,
                                                         bad_records="skip"), tok_dir, log=logs.append)
    assert len(train) == 3 and report["bad_records"] == {"no_assistant": 1, "unknown_role": 1}
    assert any("by reason: no_assistant=1, unknown_role=1" in m for m in logs)
    # a JSONL shard in a directory: file and line
    shards = build("jsonl_shards", tmp_path / "j", [good, good, good, good, good, bad_role, good, good])
    with pytest.raises(DataError, match=r"part-00002.jsonl line 2 \(messages\[1\] has the unknown role"):
        load_jsonl_splits(JsonlDataConfig(path=shards, eval_fraction=0.0, cache=False), tok_dir,
                          log=lambda m: None)


def test_cache_key_covers_every_shard(tok_dir, tmp_path):
    path = build("parquet_shards", tmp_path)
    cfg = JsonlDataConfig(path=path, max_tokens=128, cache=True, cache_dir=str(tmp_path / "cache"))
    logs = []
    first = load_jsonl_splits(cfg, tok_dir, log=logs.append)
    assert any("cached in" in m for m in logs)
    assert len(os.listdir(tmp_path / "cache")) == 1  # in the cache directory
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tokens.npz")]
    assert not [f for f in os.listdir(path) if f.endswith(".tokens.npz")]
    logs.clear()
    again = load_jsonl_splits(cfg, tok_dir, log=logs.append)
    assert any("from cache" in m for m in logs) and first[2] == again[2]
    for a, b in zip(first[0].samples, again[0].samples, strict=True):
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    # change the last shard only (one record fewer): a new key, tokenized again
    last = os.path.join(path, sorted(os.listdir(path))[-1])
    t = pq.read_table(last)
    pq.write_table(t.slice(0, t.num_rows - 1), last)
    logs.clear()
    changed = load_jsonl_splits(cfg, tok_dir, log=logs.append)
    assert any("cached in" in m for m in logs)
    assert changed[2]["records"] == 399


def test_directory_checks(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="a directory with no data files"):
        resolve_source(str(tmp_path / "empty"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text("{}\n")
    pq.write_table(pa.Table.from_pylist([{"text": "x"}]), str(mixed / "b.parquet"))
    with pytest.raises(DataError, match="must hold one file type; found jsonl, parquet"):
        resolve_source(str(mixed))
    with pytest.raises(DataError, match="no such file or directory"):
        resolve_source(str(tmp_path / "nope.parquet"))


def _hub_dataset_cache(root, records) -> str:
    """A local hub cache holding the dataset ``org/arith`` as huggingface_hub lays one out:
    ``datasets--org--arith/refs/main`` -> ``snapshots/<commit>/``, with the train split in two
    Parquet shards and a test split and README beside it (the Hub's file naming)."""
    snap = root / "datasets--org--arith" / "snapshots" / "c0ffee"
    (snap / "data").mkdir(parents=True)
    (root / "datasets--org--arith" / "refs").mkdir()
    (root / "datasets--org--arith" / "refs" / "main").write_text("c0ffee")
    half = len(records) // 2
    for k, part in enumerate((records[:half], records[half:])):
        pq.write_table(pa.Table.from_pylist(full_rows(part)), str(snap / "data" / f"train-{k:05d}-of-00002.parquet"))
    pq.write_table(pa.Table.from_pylist(full_rows(records[:5])), str(snap / "data" / "test-00000-of-00001.parquet"))
    (snap / "README.md").write_text("# arith\n")
    return str(snap)


def test_hub_dataset_id_reads_the_train_split_of_the_local_hub_cache(tok_dir, tmp_path, monkeypatch):
    """``data.path=org/arith`` (nothing of that name on disk) reads the local hub cache's
    snapshot -- the one huggingface_hub itself resolves offline -- and its train split only: the
    same tokens and masks as the JSONL file the shards were written from."""
    from huggingface_hub import snapshot_download

    snap = _hub_dataset_cache(tmp_path / "hub", records_of())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    source = resolve_source("org/arith")
    assert source.path == snapshot_download("org/arith", repo_type="dataset", local_files_only=True,
                                            cache_dir=str(tmp_path / "hub"))
    assert source.kind == "parquet" and [os.path.relpath(f, snap) for f in source.files] == [
        os.path.join("data", "train-00000-of-00002.parquet"), os.path.join("data", "train-00001-of-00002.parquet")]
    tok = ChatTokenizer(tok_dir)
    want, got = tokenize_jsonl(DATA, tok), tokenize_jsonl("org/arith", tok)
    assert len(want.ids) == len(got.ids) == 400
    for a, b, ma, mb in zip(want.ids, got.ids, want.masks, got.masks, strict=True):
        assert np.array_equal(a, b) and np.array_equal(ma, mb)


def test_hub_dataset_id_not_in_the_cache_is_refused_with_the_download_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as err:
        resolve_source("org/chat-data")
    assert str(err.value) == (
        "data.path 'org/chat-data': no such file or directory, and as a Hugging Face Hub dataset id "
        f"it is not in the local hub cache ({tmp_path / 'hub'}): the job reads a local copy only; "
        "download it first (huggingface-cli download org/chat-data --repo-type dataset) or set "
        "data.path=<a local file or directory>")


def test_datasets_is_optional_for_jsonl(tok_dir, tmp_path, monkeypatch):
    """JSONL needs no datasets; a Parquet file without it is refused with what, why and the fix."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    path = build("parquet", tmp_path)
    train, _, _ = load_jsonl_splits(JsonlDataConfig(path=DATA, max_tokens=128, cache=False), tok_dir,
                                    log=lambda m: None)
    assert len(train) == 360
    with pytest.raises(DataError) as e:
        load_jsonl_splits(JsonlDataConfig(path=path, cache=False), tok_dir, log=lambda m: None)
    msg = str(e.value)
    assert "is Parquet" in msg and "read through the 'datasets' library" in msg
    assert "`pip install datasets`" in msg and "could not be imported" in msg


# --------------------------------------------------------------------------- the main job
STEPS = 12
EOT_OUTSIDE = tiny.CHAT_TEMPLATE.replace(
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}",
    "{{ message['content'] | trim }}{% endgeneration %}{{ '<|eot_id|>' }}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt") / "tiny-llama")
    tiny.main(d, DATA)
    return d


def train(ckpt, data, cwd, *extra):
    run = run_main_job(["model=hf", f"model.path={ckpt}", "data=jsonl", f"data.path={data}",
                        "fastpath.lora=true", f"training.steps={STEPS}", "data.eval_every=0",
                        "metrics.tensorboard=false", "metrics.wandb=off", *TINY_CHECKPOINT_OPTIMIZER, *extra],
                       cwd, env=job_env(WANDB_MODE="offline"))
    return run


@pytest.fixture(scope="module")
def jsonl_run(ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jsonl_run")
    data = str(tmp / "chat.jsonl")
    shutil.copy(DATA, data)
    return train(ckpt, data, tmp)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["parquet", "json_array", "save_to_disk", "jsonl_shards"])
def test_main_job_trains_from_each_file_type(ckpt, jsonl_run, tmp_path, kind):
    """Loss falls, and the run is the JSONL file's run: same data report and per-step losses
    (the same tokenized records packed the same way; ids and masks: the test above)."""
    run = train(ckpt, build(kind, tmp_path / "data"), tmp_path)
    s, ref = run.summary, jsonl_run.summary
    assert s["steps"] == STEPS and s["last_loss"] < s["first_loss"] - 0.5, (s["first_loss"], s["last_loss"])
    assert s["data"] == ref["data"] and s["data"]["bad_records"] == {}
    assert [r["loss"] for r in s["records"]] == [r["loss"] for r in ref["records"]]


@pytest.mark.integration
def test_planted_bad_records_counted_by_reason_in_the_summary(ckpt, tmp_path):
    """A hand-counted set of bad records planted in the shipped file: the summary JSON carries
    exactly these counts by reason under data.bad_records=skip (and the log line too)."""
    tok = tmp_path / "tok"  # the checkpoint's tokenizer with <|eot_id|> outside the generation span
    tok.mkdir()
    shutil.copy(os.path.join(ckpt, "tokenizer.json"), tok / "tokenizer.json")
    cfg = json.load(open(os.path.join(ckpt, "tokenizer_config.json")))
    cfg["chat_template"] = EOT_OUTSIDE
    json.dump(cfg, open(tok / "tokenizer_config.json", "w"))

    def chat(user, reply, role="assistant"):
        return json.dumps({"messages": [{"role": "user", "content": user},
                                        {"role": role, "content": reply}]}).encode()

    planted = [
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',         # invalid_utf8
        b'{"prompt": "Question: 1 + 1 = ?\\nAnswer:", "completion": "\xc3"}',  # invalid_utf8
        chat("What is 2 + 2?", ""),                                          # no_loss_token (empty reply)
        chat("What is 3 + 3?", "3 + 3 = 6.", role="assistent"),              # unknown_role
        chat("What is 4 + 4?", "4 + 4 = 8.", role="Assistant"),              # unknown_role
        chat("1 " * 600, "ok"),                                              # too_long (> 512 tokens)
        b'{"messages": [{"role": "user", "content": "hi"}',                  # malformed_json
        b"{'prompt': 'single quotes', 'completion': 'x'}",                   # malformed_json
        b'{"prompt": "a", "completion": "b"} trailing',                      # malformed_json
    ]
    want = {"invalid_utf8": 2, "malformed_json": 3, "no_loss_token": 1, "too_long": 1, "unknown_role": 2}
    lines = open(DATA, "rb").read().splitlines()
    for k, bad in enumerate(planted):  # spread through the file
        lines.insert(20 + 40 * k, bad)
    data = tmp_path / "planted.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    run = train(ckpt, str(data), tmp_path, f"data.tokenizer_path={tok}", "data.bad_records=skip")
    d = run.summary["data"]
    assert d["bad_records"] == want
    assert d["malformed"] == 8 and d["too_long"] == 1 and d["records"] == 409
    assert d["train_records"] + d["eval_records"] == 400
    assert ("by reason: invalid_utf8=2, malformed_json=3, no_loss_token=1, too_long=1, "
            "unknown_role=2") in run.output
    s = run.summary
    assert s["last_loss"] < s["first_loss"] - 0.5


def test_the_format_is_logged_once_and_datasets_shows_no_progress_bars(tok_dir, tmp_path):
    """One line names the data, its records and their detected formats (the same from the
    token cache); reading through datasets turns its progress bars off."""
    datasets.enable_progress_bars()
    path = build("parquet", tmp_path)
    cfg = JsonlDataConfig(path=path, max_tokens=128, cache_dir=str(tmp_path / "cache"))
    for _ in range(2):  # tokenized, then from the cache
        logs = []
        load_jsonl_splits(cfg, tok_dir, log=logs.append)
        assert [m for m in logs if ", format " in m] == [
            f"data: {path}, 400 records, format chat messages (370 records), prompt-completion (30 records)"]
    assert datasets.utils.are_progress_bars_disabled()
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in records_of() if "messages" in r))
    logs = []
    load_jsonl_splits(JsonlDataConfig(path=str(chat), max_tokens=128, cache=False), tok_dir, log=logs.append)
    assert logs[0] == f"data: {chat}, 370 records, format chat messages"
    from megatron_fastpath.hf.data.records import formats_text

    assert formats_text((("messages", 2), ("text", 1))) == "chat messages (2 records), plain text (1 record)"
