"""Chat templates bounded in time and memory.

A chat template is a program that comes with a checkpoint (``tokenizer_config.json`` or
``chat_template.jinja``): Jinja's sandbox stops it from touching the machine, not from looping
for ever (``{% for i in range(100000) %}{% for j in range(100000) %}``) or from allocating
without limit (``'x' * 10**10``, a string doubled in a loop). Data files therefore render their
conversations in a forked helper process whose address space is capped (``RLIMIT_AS``: its
size at the fork plus :data:`TEMPLATE_MEMORY_BYTES`), one conversation per round trip with a
deadline of :data:`TEMPLATE_SECONDS`. A template that runs out of either is refused for the
whole file (it is the same program for every record), naming the record's line; the helper is
killed, the main process never ran the template. Errors a template raises on purpose
(``raise_exception``) stay per-record (reported as malformed lines, as before).

The helper never outlives the job: it holds only its own end of the pipe (so the job's death is
an EOF there), ends at that EOF or, on Linux, by ``PR_SET_PDEATHSIG`` even while rendering, and
takes the default action of SIGTERM / SIGINT / SIGUSR1 rather than the job's handlers.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

from megatron_fastpath.hf.tokenizer import TokenizerError

__all__ = ["TEMPLATE_SECONDS", "TEMPLATE_MEMORY_BYTES", "TemplateLimitError", "BoundedRenderer"]

TEMPLATE_SECONDS = 10.0  # per conversation (real templates take well under a millisecond)
TEMPLATE_MEMORY_BYTES = 1 << 30  # address space the helper may add to what it forked with


class TemplateLimitError(TokenizerError):
    """The chat template ran past its time or memory bound."""


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this process (SIGKILL) when its parent exits, even by SIGKILL
    (strictly: when the thread that forked it does; a renderer is used by the thread that
    starts it); elsewhere the helper still ends at the EOF on its pipe."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if os.getppid() != parent_pid:  # the parent ended before the prctl took effect
        os._exit(0)


def _serve(conn, parent_end, parent_pid: int, tokenizer, memory_bytes: int) -> None:
    """The helper: render conversations until told to stop (None) or the parent is gone (EOF
    on the pipe, or the parent's death on Linux). It holds only its own end of the pipe, and
    the signals the job handles (SIGTERM / SIGUSR1: save and requeue; SIGINT) end it as they
    end any process: it has nothing to save."""
    import resource

    parent_end.close()  # else the parent's death would not close the pipe: no EOF here
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)  # not the job's handlers, inherited by the fork
    _die_with_parent(parent_pid)
    limit = _vm_bytes() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    while True:
        try:
            messages = conn.recv()
        except EOFError:  # the parent is gone
            return
        if messages is None:
            return
        try:
            conn.send(("ok", tokenizer.render_samples(messages)))
        except MemoryError:
            conn.send(("memory", None))
        except TokenizerError as exc:
            conn.send(("tokenizer", str(exc)))
        except Exception as exc:  # noqa: BLE001 - the template's own errors: per record
            conn.send(("error", str(exc)))


class BoundedRenderer:
    """``with BoundedRenderer(tokenizer, where) as r: samples = r.render_samples(msgs, line)``.

    ``where``: the data file (for messages). The helper starts at the first conversation."""

    def __init__(self, tokenizer, where: str, seconds: Optional[float] = None,
                 memory_bytes: Optional[int] = None):
        self.tokenizer, self.where = tokenizer, where
        self.seconds = TEMPLATE_SECONDS if seconds is None else seconds
        self.memory_bytes = TEMPLATE_MEMORY_BYTES if memory_bytes is None else memory_bytes
        self._proc = self._conn = None

    def __enter__(self) -> "BoundedRenderer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        import multiprocessing as mp

        # fork: the helper has the tokenizer already (no re-import, no re-parse); it runs only
        # Jinja and never touches a device
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self._conn, os.getpid(), self.tokenizer,
                                                      self.memory_bytes),
                                 name="chat-template", daemon=True)
        self._proc.start()
        child.close()

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            if self._proc.is_alive():
                self._conn.send(None)
                self._proc.join(timeout=5)
        except OSError:
            pass
        finally:
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
            self._conn.close()
            self._proc = self._conn = None

    def _refuse(self, line: int, what: str) -> TemplateLimitError:
        self.close()
        return TemplateLimitError(
            f"{self.where}, line {line}: the chat template of {self.tokenizer.path} {what}; it is "
            "the same template for every record, so the file is refused. Fix the template "
            "(tokenizer_config.json 'chat_template' or chat_template.jinja), or use "
            'prompt/completion records ({"prompt": ..., "completion": ...})')

    def render_samples(self, messages: list, line: int) -> list:
        """[(text, assistant spans)] as ``ChatTokenizer.render_samples``; raises the template's own
        error as ``ValueError`` (a malformed record) and :class:`TemplateLimitError`."""
        if self._proc is None:
            self._start()
        self._conn.send(messages)
        if not self._conn.poll(self.seconds):
            raise self._refuse(line, f"did not finish rendering one conversation in "
                                     f"{self.seconds:g} s (a loop that never ends?)")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._proc.join(timeout=1)
            code = self._proc.exitcode
            raise self._refuse(line, f"stopped its helper process (exit {code}) while rendering "
                                     "one conversation") from None
        if kind == "ok":
            return value
        if kind == "memory":
            raise self._refuse(line, f"needed more than {self.memory_bytes / 2**30:g} GiB to "
                                     "render one conversation")
        if kind == "tokenizer":
            raise TokenizerError(value)
        raise ValueError(value)
