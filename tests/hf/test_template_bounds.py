"""Chat templates are programs shipped with a checkpoint: bounded in time and memory
(hf/template_guard.py). A template that never ends, or allocates without limit, is refused for
the file with the record's line, quickly, without the main process running it or growing;
tokenizer.json files far larger than any real one are refused before parsing."""

import json
import multiprocessing
import os
import resource
import time

import pytest

# the integration tier: runs the main job, a benchmark script or several processes
pytestmark = pytest.mark.integration

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
import make_tiny_hf_llama as tiny  # noqa: E402

from megatron_fastpath.hf import template_guard  # noqa: E402
from megatron_fastpath.hf.data import JsonlDataConfig, load_jsonl_splits  # noqa: E402
from megatron_fastpath.hf.tokenizer import ChatTokenizer, TokenizerError  # noqa: E402

DATA = os.path.join(EXAMPLES, "data", "arith_chat.jsonl")
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1 + 1 = 2."}]}
FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE_REPEAT = "{{ 'x' * 10000000000 }}"
DOUBLING = ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
            "{% endfor %}{{ ns.s | length }}")


def _load(tmp_path, template, records=(CHAT, CHAT)):
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    tiny.build_tokenizer(str(tok), DATA, template=template)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = JsonlDataConfig(path=str(data), eval_fraction=0.0, cache=False)
    return load_jsonl_splits(cfg, str(tok), log=lambda m: None)


def _max_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("template,reason", [
    (FOREVER, "did not finish rendering one conversation in 2 s"),
    (HUGE_REPEAT, "needed more than 0.25 GiB to render one conversation"),
    (DOUBLING, "needed more than 0.25 GiB to render one conversation"),
], ids=["nested-loop", "x*10**10", "doubling-concat"])
def test_runaway_template_is_refused_quickly_and_the_main_process_never_runs_it(
        tmp_path, monkeypatch, template, reason):
    monkeypatch.setattr(template_guard, "TEMPLATE_SECONDS", 2.0)
    monkeypatch.setattr(template_guard, "TEMPLATE_MEMORY_BYTES", 1 << 28)
    rss0, t0 = _max_rss_mib(), time.monotonic()
    with pytest.raises(template_guard.TemplateLimitError) as e:
        _load(tmp_path, template)
    assert time.monotonic() - t0 < 30
    assert _max_rss_mib() - rss0 < 200  # the 10 GB / 1 TB strings were never built here
    msg = str(e.value)
    assert reason in msg and f"{tmp_path / 'd.jsonl'}, line 1" in msg and "file is refused" in msg
    assert not [p for p in multiprocessing.active_children() if p.name == "chat-template"]  # gone


def test_templates_own_errors_stay_per_record(tmp_path):
    """``raise_exception`` in a template (e.g. a role it does not support) is one bad record,
    reported with its line, as before the helper process."""
    template = ("{% if messages[0].content == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}"
                + tiny.CHAT_TEMPLATE)
    bad = {"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]}
    tok = tmp_path / "tok"
    tok.mkdir()
    tiny.build_tokenizer(str(tok), DATA, template=template)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (CHAT, bad, CHAT)))
    cfg = JsonlDataConfig(path=str(data), eval_fraction=0.0, cache=False, bad_records="skip")
    train, _, report = load_jsonl_splits(cfg, str(tok), log=lambda m: None)
    assert report["malformed"] == 1 and len(train) == 2
    # the helper's rendering equals the in-process one
    from megatron_fastpath.hf.data import tokenize_jsonl

    tokenizer = ChatTokenizer(str(tok))
    got = tokenize_jsonl(str(data), tokenizer)
    ids, mask = tokenizer.encode_chat(CHAT["messages"])
    assert got.lines == [1, 3] and [w for w, *_ in got.malformed] == ["line 2"]
    assert got.ids[0].tolist() == ids and got.masks[0].tolist() == mask
    assert "no boom here" in got.malformed[0][2] and got.malformed[0][1] == "template_error"


def test_oversized_tokenizer_json_is_refused_before_parsing(tmp_path):
    tiny.build_tokenizer(str(tmp_path), DATA)
    with open(tmp_path / "tokenizer.json", "r+b") as f:  # sparse: 240 MiB on paper, no disk
        f.truncate(240 * 2**20)
    t0 = time.monotonic()
    with pytest.raises(TokenizerError, match=r"tokenizer.json is 240 MiB; .* well under 128 MiB"):
        ChatTokenizer(str(tmp_path))
    assert time.monotonic() - t0 < 5


OWNER = """
import signal, sys, time
from megatron_fastpath.hf.template_guard import BoundedRenderer
from megatron_fastpath.hf.tokenizer import ChatTokenizer
signal.signal(signal.SIGTERM, lambda *a: None)  # the job handles SIGTERM (save, requeue)
renderer = BoundedRenderer(ChatTokenizer(sys.argv[1]), "d.jsonl")
renderer.render_samples({messages}, 1)
print(renderer._proc.pid, flush=True)
time.sleep(600)
""".replace("{messages}", repr(CHAT["messages"]))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: exited, not yet reaped
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return _gone(pid)


def _owner_and_helper(tmp_path):
    import signal
    import subprocess
    import sys

    from tests.support.subproc import child_env

    tok = tmp_path / "tok"
    tok.mkdir()
    tiny.build_tokenizer(str(tok), DATA)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tok)], stdout=subprocess.PIPE, text=True,
                             env=child_env())
    helper = int(owner.stdout.readline())
    assert not _gone(helper)
    return owner, helper, signal


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_the_template_helper_ends_when_the_job_is_killed(tmp_path):
    """The job killed (-9) while tokenizing: its template helper ends with it (it held the
    job's end of its pipe, so it never saw EOF, and stayed alive, orphaned)."""
    owner, helper, signal = _owner_and_helper(tmp_path)
    try:
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        assert _wait_gone(helper, 5), f"the template helper {helper} outlived the job"
    finally:
        if not _gone(helper):
            os.kill(helper, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_the_template_helper_ends_on_sigterm(tmp_path):
    """SIGTERM ends the helper (it inherited the job's SIGTERM handler, which ignores it there)."""
    owner, helper, signal = _owner_and_helper(tmp_path)
    try:
        os.kill(helper, signal.SIGTERM)
        assert _wait_gone(helper, 5), f"the template helper {helper} ignored SIGTERM"
    finally:
        for pid in (helper, owner.pid):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        owner.wait(timeout=10)
