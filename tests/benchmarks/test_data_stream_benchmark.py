"""Bounded-memory tokenize-and-pack: the streamed data path gives the SAME
samples, held-out split and bins as a plain in-memory reference (below: the whole file split
into lines, a list of arrays per record, groups in a dict, first-fit scanning every open bin), and ``benchmarks/data_stream.py`` reports records/s, bins and peak
RSS for what it generated."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

from tests.support.benchmark_run import run_benchmark

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "arith_chat.jsonl"


def reference_ffd(lengths, max_tokens, max_seqs, pad_multiple=1):
    """first_fit_decreasing as committed before the streaming path (0607857)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins, room = [], []
    for i in order:
        n = int(lengths[i])
        if n <= 0:
            raise ValueError(f"sample {i} has non-positive length {n}")
        n = -(-n // pad_multiple) * pad_multiple
        if n > max_tokens:
            raise ValueError(f"sample {i} has {n} tokens, more than a bin holds ({max_tokens})")
        for b, free in enumerate(room):
            if free >= n and len(bins[b]) < max_seqs:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
    return bins


def reference_splits(path, tok, cfg):
    """(train, eval) as [(line, tokens int64, loss float32)] and the too-long / malformed counts,
    the way the committed code made them: every line of the file at once, one array pair per
    record, records grouped by line in a dict, the held-out groups sorted back."""
    from megatron_fastpath.hf.data.records import _validate

    ids, masks, nums, malformed = [], [], [], 0
    for k, raw in enumerate(open(path, "rb").read().split(b"\n"), start=1):
        line = raw.decode("utf-8")
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            malformed += 1
            continue
        kind, payload, why = _validate(rec, cfg.format, None)
        assert kind == "pc", why
        i, m = tok.encode_prompt_completion(*payload)
        ids.append(np.asarray(i, dtype=np.int32))
        masks.append(np.asarray(m, dtype=np.uint8))
        nums.append(k)
    keep = [k for k, i in enumerate(ids) if len(i) <= cfg.max_tokens]
    groups = {}
    for k in keep:
        groups.setdefault(nums[k], []).append(k)
    groups = list(groups.values())
    order = np.random.default_rng(cfg.seed).permutation(len(groups))
    n_eval = max(1, int(round(cfg.eval_fraction * len(groups))))
    eval_idx = sorted(k for j in order[:n_eval] for k in groups[j])
    train_idx = sorted(k for j in order[n_eval:] for k in groups[j])

    def sample(k):
        loss = np.zeros(len(ids[k]), dtype=np.float32)
        loss[:-1] = masks[k][1:]
        return nums[k], ids[k].astype(np.int64), loss

    return ([sample(k) for k in train_idx], [sample(k) for k in eval_idx],
            dict(malformed=malformed, too_long=len(ids) - len(keep)))


def generated_file(path, n=3000, seed=0):
    rng = random.Random(seed)
    words = "the a of to and in is it you that he was for on are with as his they at one have this".split()
    with open(path, "w", encoding="utf-8") as f:
        for k in range(n):
            if k % 211 == 7:
                f.write("{not json\n")
            elif k % 307 == 11:
                f.write("\n")
            else:
                total = rng.randint(5, 40)
                p = rng.randint(2, 15)
                f.write(json.dumps({"prompt": " ".join(rng.choices(words, k=p)),
                                    "completion": " " + " ".join(rng.choices(words, k=total))}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    import make_tiny_hf_llama as tiny

    d = str(tmp_path_factory.mktemp("tok"))
    tiny.build_tokenizer(d, str(DATA))
    return d


@pytest.mark.parametrize("pad", [1, 2])
def test_streamed_path_gives_the_committed_samples_split_and_bins(tok_dir, tmp_path, pad):
    from megatron_fastpath.data import DataConfig, pack_microbatches
    from megatron_fastpath.hf.data import JsonlDataConfig, load_jsonl_splits
    from megatron_fastpath.hf.tokenizer import ChatTokenizer

    path = generated_file(tmp_path / "gen.jsonl")
    cfg = JsonlDataConfig(path=path, max_tokens=64, max_seqs=8, eval_fraction=0.1, cache=True,
                          bad_records="skip")
    want_train, want_eval, counts = reference_splits(path, ChatTokenizer(tok_dir), cfg)
    assert counts["malformed"] > 5 and counts["too_long"] > 50  # both refusals exercised
    for attempt in ("tokenized", "from the cache"):
        train, held, report = load_jsonl_splits(cfg, tok_dir, log=lambda m: None)
        assert (report["malformed"], report["too_long"]) == (counts["malformed"], counts["too_long"])
        for got, want in ((train, want_train), (held, want_eval)):
            assert list(got.lines) == [w[0] for w in want], attempt
            for (t, m), (_, wt, wm) in zip(got.samples, want, strict=True):
                assert t.dtype == wt.dtype and np.array_equal(t, wt) and np.array_equal(m, wm)
            assert got.num_loss_tokens == int(sum(w[2].sum() for w in want))
            assert got.max_token_id == max(int(w[1].max()) for w in want)
            # bins: the committed first-fit over the same lengths, and the same padded tensors
            lengths = [len(w[1]) for w in want]
            bins = pack_microbatches(got, DataConfig(max_tokens=64, max_seqs=8, pad_multiple=pad))
            ref = reference_ffd(lengths, 64, 8, pad)
            assert [bins.indices(k) for k in range(len(bins))] == ref
            for mb, idx in zip(bins, ref, strict=True):
                toks = np.concatenate([want[i][1] for i in idx])
                assert np.array_equal(mb.tokens_1T[0, :len(toks)].numpy(), toks)
                assert mb.lengths.tolist() == [lengths[i] for i in idx]
                assert mb.num_loss_tokens == int(sum(want[i][2].sum() for i in idx))


def test_first_fit_decreasing_equals_the_committed_algorithm():
    from megatron_fastpath.packed_seq.packing import first_fit_decreasing

    rng = np.random.default_rng(0)
    for _ in range(300):
        max_tokens, max_seqs = int(rng.integers(8, 600)), int(rng.integers(1, 40))
        pad = int(rng.choice([1, 2, 4]))
        lengths = rng.integers(1, int(rng.integers(1, max_tokens + 1)) + 1,
                               size=int(rng.integers(0, 300))).tolist()
        try:
            want = reference_ffd(lengths, max_tokens, max_seqs, pad)
        except ValueError as exc:
            with pytest.raises(ValueError, match=str(exc).replace("(", r"\(").replace(")", r"\)")):
                first_fit_decreasing(lengths, max_tokens, max_seqs, pad)
            continue
        assert first_fit_decreasing(lengths, max_tokens, max_seqs, pad) == want
    for bad in ([10, 600], [0, 5], [5, -1, 0]):
        with pytest.raises(ValueError) as got:
            first_fit_decreasing(bad, 512, 4)
        with pytest.raises(ValueError) as want:
            reference_ffd(bad, 512, 4)
        assert str(got.value) == str(want.value)


def test_shipped_data_bins_equal_the_committed_first_fit(tok_dir):
    from megatron_fastpath.data import DataConfig, epoch_order, pack_microbatches
    from megatron_fastpath.hf.data import JsonlDataConfig, load_jsonl_splits

    cfg = JsonlDataConfig(path=str(DATA), max_tokens=128, max_seqs=8, cache=False, bad_records="skip")
    train, held, _ = load_jsonl_splits(cfg, tok_dir, log=lambda m: None)
    for ds in (train, held):
        bins = pack_microbatches(ds, DataConfig(max_tokens=128, max_seqs=8, pad_multiple=1))
        assert [bins.indices(k) for k in range(len(bins))] == reference_ffd(ds.lengths.tolist(), 128, 8)
        # an epoch's order: the committed one (first-fit over the shuffled lengths, mapped back)
        rng = np.random.default_rng([7, 1])
        perm = rng.permutation(len(ds.lengths))
        ref = [[int(perm[j]) for j in b] for b in reference_ffd([int(ds.lengths[i]) for i in perm], 128, 8)]
        assert epoch_order(ds.lengths, 128, 8, 7, 1) == [ref[k] for k in rng.permutation(len(ref))]


@pytest.mark.integration
def test_benchmark_reports_rates_bins_and_peak_rss(tmp_path):
    out = tmp_path / "d.json"
    result = run_benchmark("data_stream", out, "--sizes", "20000", "--repeats", "1", "--old-size", "0", timeout=600)
    (gen,) = result["generation"]
    assert gen["records"] == 20000 and gen["malformed"] == 2
    rows = result["results"]
    assert [(r["size"], r["impl"], r["phase"]) for r in rows] == [(20000, "new", "tokenize"), (20000, "new", "cached")]
    for r in rows:
        assert r["records"] == 20000 and r["refused"] == gen["malformed"] + r["bad_records"].get("too_long", 0)
        assert r["train_records"] + r["eval_records"] == r["records"] - r["refused"]
        assert r["train_bins"] > 0 and r["tokens"] > 0 and r["records_per_s"] > 0
        assert r["peak_rss_mib"] >= r["rss_after_imports_mib"] > 0
    assert rows[0]["tokens"] == rows[1]["tokens"] and rows[0]["train_bins"] == rows[1]["train_bins"]
    assert "peak RSS" in out.with_suffix(".txt").read_text()
