"""A checkpoint's tokenizer and chat template without transformers.

:class:`ChatTokenizer` reads ``tokenizer.json`` (the ``tokenizers`` library) and the chat
template from ``tokenizer_config.json`` (or ``chat_template.jinja``), renders it the way
transformers' ``apply_chat_template`` does -- in Jinja's ``ImmutableSandboxedEnvironment``
(a template is untrusted input) with ``trim_blocks`` / ``lstrip_blocks``, loop controls, the
``tojson`` / ``raise_exception`` / ``strftime_now`` helpers and the ``{% generation %}`` tag --
and returns token ids with an assistant mask (1 on tokens the model should learn to produce).

Assistant spans: from ``{% generation %}`` blocks when the template has them (exactly as
transformers' ``return_assistant_tokens_mask``); otherwise by rendering each conversation prefix
(``messages[:i]`` + generation prompt, then ``messages[:i+1]``): the characters the assistant
turn adds, up to its last non-space character (the reply and its end-of-turn token, not the
template's newline after it), are its span.

Templates that render earlier turns differently from the last one (Qwen3's drops the
``<think>`` reasoning of every assistant turn before the last user message) do not render
prefixes as prefixes: :meth:`ChatTokenizer.render_samples` then trains such a conversation as
one sample per assistant turn -- sample k is the conversation up to and including assistant turn
k, rendered on its own (turn k is its last turn, rendered as the template renders a final turn),
with turn k's span alone, as TRL and other fine-tuning tools do. A template that does not even
render ``messages[:i+1]`` as an extension of ``messages[:i]`` + generation prompt is refused.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from typing import Optional

__all__ = ["ChatTokenizer", "TokenizerError"]

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
            "mask_token")


class TokenizerError(ValueError):
    """The tokenizer files cannot serve the requested data."""


# The largest tokenizer.json read: real ones are 2-35 MiB (Llama 3 9, Qwen 3 11, Gemma 3 33);
# a 240 MiB one stalled start-up for more than 300 s without a line of output.
MAX_TOKENIZER_JSON_BYTES = 128 * 2**20


def _token_str(v) -> Optional[str]:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _compile(template: str):
    """transformers' ``_compile_jinja_template``, reimplemented on jinja2 alone."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(tracker=self)
            self.blocks = None
            self.spans = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

        def _track(self, caller):
            rv = caller()
            if self.blocks is not None:
                start = len("".join(self.blocks))
                self.spans.append((start, start + len(rv)))
            return rv

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _own_file(model_dir: str, path: str) -> str:
    """``path`` (a file of ``model_dir``) resolved, when it is a regular file of the directory;
    TokenizerError otherwise: a link out of the directory (what the template reads is the
    checkpoint's own file, not whatever the link names), a FIFO (reading it would block), a
    device or a directory. A Hugging Face cache snapshot (``<repo>/snapshots/<revision>``)
    links its files to ``<repo>/blobs``: those are the checkpoint's own."""
    import stat

    real, where = os.path.realpath(path), os.path.abspath(model_dir)
    roots = [os.path.realpath(where)]
    if os.path.basename(os.path.dirname(where)) == "snapshots":
        roots.append(os.path.realpath(os.path.join(os.path.dirname(os.path.dirname(where)), "blobs")))
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise TokenizerError(f"{path} resolves to {real}, outside the model directory {model_dir}: "
                             "refusing to read it; put the file itself in the directory")
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        raise TokenizerError(f"{path} cannot be read ({exc.strerror})") from exc
    if not stat.S_ISREG(mode):
        raise TokenizerError(f"{path} is not a regular file (a FIFO, device or directory): "
                             "refusing to read it; put the template file itself in the directory")
    return real


class ChatTokenizer:
    """tokenizer.json + tokenizer_config.json of a checkpoint directory."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.path = path
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise TokenizerError(f"{tok_file} not found: the checkpoint needs a fast tokenizer "
                                 "(tokenizer.json) for data=jsonl")
        size = os.path.getsize(tok_file)
        if size > MAX_TOKENIZER_JSON_BYTES:
            raise TokenizerError(
                f"{tok_file} is {size / 2**20:.0f} MiB; tokenizer files of real checkpoints are "
                f"well under {MAX_TOKENIZER_JSON_BYTES // 2**20} MiB (parsing this one would stall "
                "start-up for minutes): check that the directory holds the model's own tokenizer")
        try:
            self.tokenizer = Tokenizer.from_file(tok_file)
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            raise TokenizerError(f"{tok_file} cannot be read as a tokenizer ({first}): truncated or "
                                 "not a tokenizers file; re-download it from the model's repository") from None
        cfg_file = os.path.join(path, "tokenizer_config.json")
        self.config = json.load(open(cfg_file, encoding="utf-8")) if os.path.isfile(cfg_file) else {}
        smap = os.path.join(path, "special_tokens_map.json")
        special = json.load(open(smap, encoding="utf-8")) if os.path.isfile(smap) else {}
        self.special_tokens = {}
        for name in _SPECIAL:
            value = _token_str(self.config.get(name)) or _token_str(special.get(name))
            if value:
                self.special_tokens[name] = value
        extra = self.config.get("additional_special_tokens") or special.get("additional_special_tokens")
        if extra:
            self.special_tokens["additional_special_tokens"] = [_token_str(t) for t in extra]
        self.chat_template = self._find_template()
        self._compiled = None

    def _find_template(self) -> Optional[str]:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_file = os.path.join(self.path, "chat_template.jinja")
        if template is None and os.path.lexists(jinja_file):
            with open(_own_file(self.path, jinja_file), encoding="utf-8") as f:
                template = f.read()
        return template

    @property
    def has_generation_tags(self) -> bool:
        return bool(self.chat_template and re.search(r"\{\%-?\s*generation\s*-?\%\}", self.chat_template))

    def token_id(self, token: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise TokenizerError(f"{self.path}: special token {token!r} is not in tokenizer.json")
        return i

    @property
    def eos_id(self) -> Optional[int]:
        eos = self.special_tokens.get("eos_token")
        return self.token_id(eos) if eos else None

    def require_template(self) -> None:
        if not self.chat_template:
            raise TokenizerError(
                f"{os.path.join(self.path, 'tokenizer_config.json')} has no 'chat_template' (and no "
                "chat_template.jinja): chat records need one. Add a template, or use "
                "prompt/completion records ({\"prompt\": ..., \"completion\": ...})")

    # ------------------------------------------------------------------ rendering
    def render(self, messages: list, add_generation_prompt: bool = False, track: bool = False):
        """(text, generation spans in characters) as transformers renders it."""
        self.require_template()
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        tracker = self._compiled.environment.tracker
        kwargs = dict(messages=messages, tools=None, documents=None,
                      add_generation_prompt=add_generation_prompt, **self.special_tokens)
        if not track:
            return self._compiled.render(**kwargs), []
        tracker.blocks, tracker.spans = [], []
        try:
            for block in self._compiled.generate(**kwargs):
                tracker.blocks.append(block)
            return "".join(tracker.blocks), tracker.spans
        finally:
            tracker.blocks, tracker.spans = None, None

    def _turn_span(self, messages: list, i: int) -> tuple[str, tuple]:
        """(rendering of ``messages[:i+1]``, the characters assistant turn ``i`` adds to
        ``messages[:i]`` + generation prompt, up to its last non-space character)."""
        before, _ = self.render(messages[:i], add_generation_prompt=True)
        upto, _ = self.render(messages[: i + 1])
        if not upto.startswith(before):
            raise self._rewrites_error()
        end = len(upto)
        while end > len(before) and upto[end - 1].isspace():
            end -= 1  # the template's separator after the end-of-turn token
        return upto, (len(before), end)

    def _rewrites_error(self) -> "TokenizerError":
        return TokenizerError(
            f"{self.path}: the chat template does not render conversation prefixes as "
            "prefixes (it rewrites earlier turns), so assistant tokens cannot be located; "
            "use a template with {% generation %} tags")

    def _prefix_spans(self, messages: list, text: str) -> list:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            upto, span = self._turn_span(messages, i)
            if not text.startswith(upto):
                raise self._rewrites_error()
            spans.append(span)
        return spans

    def encode_chat(self, messages: list) -> tuple[list, list]:
        """(token ids, assistant mask) of one conversation; the mask marks the tokens of each
        assistant span exactly as transformers' ``return_assistant_tokens_mask`` does. (Data
        files render through :class:`~megatron_fastpath.hf.template_guard.BoundedRenderer`:
        the same two halves, the template's half bounded in time and memory.) Refuses a
        template that rewrites earlier turns: :meth:`encode_chat_samples` splits those."""
        return self.tokens_and_mask(*self.render_chat(messages))

    def encode_chat_samples(self, messages: list) -> list:
        """[(token ids, assistant mask)] of one conversation as data files train it: one
        sample (:meth:`encode_chat`), or one per assistant turn when the template renders
        earlier turns differently from the last one (:meth:`render_samples`)."""
        return [self.tokens_and_mask(text, spans) for text, spans in self.render_samples(messages)]

    def render_chat(self, messages: list) -> tuple[str, list]:
        """(text, assistant spans in characters) of one conversation: the template's part."""
        text, spans = self.render(messages, track=self.has_generation_tags)
        if not self.has_generation_tags:
            spans = self._prefix_spans(messages, text)
        return text, spans

    def render_samples(self, messages: list) -> list:
        """[(text, assistant spans)]: the conversation as one sample (:meth:`render_chat`)
        when the template renders its prefixes as prefixes (or has ``{% generation %}`` tags);
        otherwise one sample per assistant turn k -- ``messages`` up to and including turn k,
        rendered on its own (turn k renders as the last turn, e.g. keeping its reasoning), with
        turn k's span only. Every sample's text is ``apply_chat_template(messages[:i+1])``."""
        if self.has_generation_tags:
            return [self.render_chat(messages)]
        text, _ = self.render(messages)
        try:
            return [(text, self._prefix_spans(messages, text))]
        except TokenizerError:
            pass  # earlier turns render differently from the last one: a sample per turn
        samples = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                upto, span = self._turn_span(messages, i)  # refuses if even this is no prefix
                samples.append((upto, [span]))
        return samples

    def tokens_and_mask(self, text: str, spans: list) -> tuple[list, list]:
        """Token ids of ``text`` and the mask of the tokens inside ``spans``."""
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = enc.ids
        mask = [0] * len(ids)
        for start_c, end_c in spans:
            if end_c <= start_c:
                continue
            start = enc.char_to_token(start_c)
            end = enc.char_to_token(end_c - 1)
            if start is None:
                break
            for t in range(start, end + 1 if end else len(ids)):
                mask[t] = 1
        return ids, mask

    def encode_prompt_completion(self, prompt: str, completion: str) -> tuple[list, list]:
        """prompt with the tokenizer's own special tokens (BOS), completion + EOS in the loss."""
        p = self.tokenizer.encode(prompt, add_special_tokens=True).ids
        c = self.tokenizer.encode(completion, add_special_tokens=False).ids
        eos = self.eos_id
        c = c + ([eos] if eos is not None else [])
        return p + c, [0] * len(p) + [1] * len(c)
