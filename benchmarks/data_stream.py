"""Tokenize-and-pack throughput and peak memory of ``data=jsonl`` on many short records.

``python benchmarks/data_stream.py [--sizes 100000 1000000] [--repeats 2] [--old-size 100000]
[--json benchmarks/results/data_stream.json]``

Generates N seeded prompt / completion records of 5-40 words each (plus one malformed line in
every 10,000, refused and counted) into a JSONL file in a temporary directory -- timed apart --
and a small BPE tokenizer built there with ``tokenizers`` (nothing downloaded). Then, per size
and repeat, a FRESH child process runs the main job's data path, ``JsonlData.build`` (the
function the job calls to turn ``data.path`` into packed bins: read, tokenize, cache, split,
pack), then reads every train bin once as training would, and reports records/s, tokens/s, the
bins and its peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``: the child's own, so peaks do not
carry over; it includes the interpreter, torch, numpy and tokenizers imports, given apart as
the RSS after imports). Phases: ``tokenize`` (no cache beside the data: read + tokenize + write
the cache + pack) and ``cached`` (the cache written by the run before it is read). Times are
the minimum over the repeats, RSS the maximum.

``--old-size``: the implementation of the commit before the streaming path
(``--old-commit``, read with ``git show``: lists of per-record arrays, the whole file read at
once, every bin padded up front, first-fit scanning every open bin) at that size, in the same
kind of child process, for comparison (0: skip).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))  # load_meter
from load_meter import LoadMeter  # noqa: E402

OLD_COMMIT = "0607857"  # the data path before streaming
OLD_FILES = ("megatron_fastpath/hf/data.py", "megatron_fastpath/data.py",
             "megatron_fastpath/packed_seq/packing.py")
BAD_EVERY = 10_000  # one malformed line in this many records
MAX_TOKENS, MAX_SEQS = 512, 32


def _words(rng: random.Random, n: int = 3000) -> list:
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    weights = [12, 9, 8, 8, 7, 7, 6, 6, 6, 4, 4, 3, 3, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    return sorted({"".join(rng.choices(letters, weights, k=rng.randint(2, 9))) for _ in range(n)})


def generate(path: str, n: int, seed: int = 0) -> dict:
    """N records (prompt 2-15 words, completion so that both hold 5-40 words), a malformed
    line in every ``BAD_EVERY``; returns counts and the seconds it took."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    words = _words(random.Random(1234))
    bad = 0
    with open(path, "w", encoding="utf-8") as f:
        for k in range(n):
            if k % BAD_EVERY == BAD_EVERY - 1:
                f.write('{"prompt": "unterminated\n')
                bad += 1
                continue
            total = rng.randint(5, 40)
            p = rng.randint(2, min(15, total - 1))
            ws = rng.choices(words, k=total)
            f.write(json.dumps({"prompt": " ".join(ws[:p]), "completion": " " + " ".join(ws[p:])}) + "\n")
    return dict(records=n, malformed=bad, bytes=os.path.getsize(path),
                seconds=round(time.perf_counter() - t0, 3))


def build_tokenizer(out_dir: str, sample: str, vocab_size: int = 2048) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    import make_tiny_hf_llama as tiny

    tiny.build_tokenizer(out_dir, sample, vocab_size=vocab_size)


# ----------------------------------------------------------------------------------- child
def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def _load_old(old_dir: str) -> None:
    """The pre-streaming modules in place of today's, before anything imports them."""
    import importlib.util

    importlib.import_module("megatron_fastpath.packed_seq")  # today's package, then the old module in it

    for rel in OLD_FILES[::-1]:  # packing first: the old data.py imports it
        name = rel[:-3].replace("/", ".")
        spec = importlib.util.spec_from_file_location(name, os.path.join(old_dir, rel))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)


def _old_build(cfg, dp_rank: int, dp_world: int, log):
    """JsonlData.build of the old commit (its data steps; no eval prompts)."""
    from megatron_fastpath.data import pack_microbatches, train_step_data
    from megatron_fastpath.hf.data import load_jsonl_splits

    train, held, report = load_jsonl_splits(cfg.data, cfg.model_source.tokenizer_path, log=log)
    if max(int(x.max()) for x, _ in train.samples) >= cfg.model.vocab_size:
        raise ValueError("token ids exceed vocab_size")
    pad = 2 * cfg.parallel.context_parallel_size
    order = train_step_data(train, cfg, pad, dp_rank, dp_world)
    held_bins = pack_microbatches(held, cfg.data, pad) if held is not None else []
    report = dict(report, train_microbatches=len(order.bins), eval_microbatches=len(held_bins))
    return types.SimpleNamespace(train=order, eval_bins=tuple(held_bins[dp_rank::dp_world]),
                                 report=report)


def child(args) -> None:
    t0 = time.perf_counter()
    if args.impl == "old":
        _load_old(args.old_dir)
    importlib.import_module("megatron_fastpath.data")  # torch, megatron.core: imported by any job already
    from megatron_fastpath.hf.data import JsonlDataConfig
    from megatron_fastpath.hf.provider import JsonlData
    from megatron_fastpath.hf.tokenizer import ChatTokenizer
    from megatron_fastpath.providers import ModelSource

    ChatTokenizer(args.tok)  # the tokenizers library loaded too

    rss_imports = _rss_mib()
    import_s = time.perf_counter() - t0
    # the token cache beside the records (the old commit's place; today's data.cache_dir)
    fields = {f.name for f in dataclasses.fields(JsonlDataConfig)}
    where = {"cache_dir": os.path.dirname(os.path.abspath(args.path))} if "cache_dir" in fields else {}
    if "pad_multiple" in fields:  # the old commit's packing at CP 1: every sample padded to 2
        where["pad_multiple"] = 2
    data = JsonlDataConfig(path=args.path, max_tokens=MAX_TOKENS, max_seqs=MAX_SEQS, eval_fraction=0.01,
                           bad_records="skip", cache=True, **where)
    ns = types.SimpleNamespace
    cfg = ns(data=data, model_source=ModelSource("hf", None, None, tokenizer_path=args.tok),
             model=ns(vocab_size=1 << 20), parallel=ns(context_parallel_size=1),
             training=ns(micro_batches=1, epochs=None))
    logs = []
    t1 = time.perf_counter()
    parts = (_old_build if args.impl == "old" else JsonlData().build)(cfg, 0, 1, log=logs.append)
    build_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    bins = parts.train.bins
    packed_tokens = sum(mb.num_tokens for mb in bins)  # every train bin read once, as a run would
    read_s = time.perf_counter() - t2
    eval_tokens = sum(mb.num_tokens for mb in parts.eval_bins)
    r = parts.report
    print(json.dumps(dict(
        impl=args.impl, from_cache=any("from cache" in m for m in logs), import_s=round(import_s, 3),
        build_s=round(build_s, 3), read_bins_s=round(read_s, 3), rss_after_imports_mib=round(rss_imports, 1),
        peak_rss_mib=round(_rss_mib(), 1), records=r["records"], refused=r["malformed"] + r["too_long"],
        bad_records=r["bad_records"], train_records=r["train_records"], eval_records=r["eval_records"],
        train_bins=r["train_microbatches"], eval_bins=r["eval_microbatches"],
        tokens=packed_tokens + eval_tokens)))


# ----------------------------------------------------------------------------------- parent
def run_child(path: str, tok: str, impl: str, old_dir: str | None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--path", path, "--tok", tok,
           "--impl", impl] + (["--old-dir", old_dir] if old_dir else [])
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TQDM_DISABLE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _clear_cache(path: str) -> None:
    d, base = os.path.split(path)
    for f in os.listdir(d):
        if f.startswith(base + ".") and f.endswith(".tokens.npz"):
            os.remove(os.path.join(d, f))


def measure(sizes, repeats: int, old_size: int, workdir: str, old_commit: str = OLD_COMMIT,
            log=print) -> tuple:
    """(generation rows, measurement rows)."""
    tok = os.path.join(workdir, "tok")
    sample = os.path.join(workdir, "sample.jsonl")
    generate(sample, 5000, seed=99)
    build_tokenizer(tok, sample)
    old_dir = None
    if old_size:
        old_dir = os.path.join(workdir, "old")
        for rel in OLD_FILES:
            os.makedirs(os.path.dirname(os.path.join(old_dir, rel)), exist_ok=True)
            src = subprocess.run(["git", "-C", str(REPO), "show", f"{old_commit}:{rel}"], check=True,
                                 capture_output=True).stdout
            Path(old_dir, rel).write_bytes(src)
    gens, rows = [], []
    for n in sorted(set(sizes) | ({old_size} if old_size else set())):
        path = os.path.join(workdir, f"records_{n}.jsonl")
        g = generate(path, n)
        gens.append(g)
        log(f"generated {n} records ({g['bytes'] / 2**20:.0f} MiB) in {g['seconds']:.1f} s", flush=True)
        impls = (["new"] if n in sizes else []) + (["old"] if n == old_size else [])
        for impl in impls:
            for phase in ("tokenize", "cached"):
                runs = []
                for rep in range(repeats if impl == "new" else 1):
                    if phase == "tokenize":
                        _clear_cache(path)
                    # cached: the cache the tokenize phase's last run wrote (this implementation's)
                    r = run_child(path, tok, impl, old_dir)
                    assert r["from_cache"] == (phase == "cached"), r
                    runs.append(r)
                    log(f"  {impl} {phase} n={n} rep {rep}: build {r['build_s']:.1f} s, "
                        f"peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
                best = min(runs, key=lambda r: r["build_s"])
                row = dict(best, size=n, phase=phase, repeats=len(runs),
                           peak_rss_mib=max(r["peak_rss_mib"] for r in runs),
                           build_s_all=[r["build_s"] for r in runs])
                row["records_per_s"] = round(row["records"] / row["build_s"])
                row["tokens_per_s"] = round(row["tokens"] / row["build_s"])
                rows.append(row)
        _clear_cache(path)
        os.remove(path)
    return gens, rows


def table(gens: list, rows: list) -> str:
    impl = {"new": "streaming", "old": f"before ({OLD_COMMIT})"}
    out = ["| records | implementation | phase | s (min) | records/s | tokens/s | tokens | refused "
           "| train + eval bins | bins read, s | peak RSS MiB (after imports) |",
           "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['records']:,} | {impl[r['impl']]} | {r['phase']} | {r['build_s']:.1f} | "
                   f"{r['records_per_s']:,} | {r['tokens_per_s']:,} | {r['tokens']:,} | {r['refused']} | "
                   f"{r['train_bins']:,} + {r['eval_bins']:,} | {r['read_bins_s']:.1f} | "
                   f"{r['peak_rss_mib']:,.0f} ({r['rss_after_imports_mib']:,.0f}) |")
    gen = ", ".join(f"{g['records']:,} in {g['seconds']:.1f} s ({g['bytes'] / 2**20:.0f} MiB)" for g in gens)
    return "\n".join(out) + f"\n\ngenerated (not in the times above): {gen}"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--old-size", type=int, default=100_000)
    ap.add_argument("--old-commit", default=OLD_COMMIT)
    ap.add_argument("--workdir", default=None, help="default: a temporary directory, removed after")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--tok", help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="new", help=argparse.SUPPRESS)
    ap.add_argument("--old-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return {}
    workdir = args.workdir or tempfile.mkdtemp(prefix="data_stream_")
    try:
        with LoadMeter() as meter:
            gens, rows = measure(args.sizes, args.repeats, args.old_size, workdir, args.old_commit)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    import numpy
    import tokenizers

    env = dict(python=sys.version.split()[0], numpy=numpy.__version__, tokenizers=tokenizers.__version__,
               **meter.report())
    text = table(gens, rows) + "\n" + meter.line()
    print(text)
    result = {"environment": env, "config": {k: (str(v) if isinstance(v, Path) else v)
                                             for k, v in vars(args).items()
                                             if k not in ("json", "child", "path", "tok", "impl", "old_dir")},
              "max_tokens": MAX_TOKENS, "max_seqs": MAX_SEQS, "bad_every": BAD_EVERY,
              "generation": gens, "results": rows}
    if args.json:
        from load_meter import write_results

        write_results(args.json, result, text)
    return result


if __name__ == "__main__":
    main()
