"""One record of the data -> its format and what it trains: the formats ``data.format`` names,
their detection from a record's keys (as TRL detects a dataset's), each format's checks and its
normal form (chat messages, prompt + completion, or plain text), and the size limits that refuse
a record too long for ``data.max_tokens`` before it is parsed or tokenized."""

from __future__ import annotations

from typing import Optional

__all__ = ["FORMATS", "COLUMNS", "ROLES", "SHAREGPT_ROLES", "CHARS_PER_TOKEN", "record_char_limit", "line_byte_limit"]

# A record is refused as too long before it is parsed or tokenized when it cannot fit
# data.max_tokens: its text (the strings of its messages, prompt / completion or text) may hold
# at most CHARS_PER_TOKEN characters per token of data.max_tokens (real tokenizers average 3-5;
# 32 leaves room for long tokens such as runs of spaces), and a JSONL line at most
# LINE_BYTES_PER_CHAR bytes per such character (a \uXXXX surrogate pair is 12 bytes for one
# character) plus LINE_BYTES_SLACK for the record's keys. So one huge record costs a bounded
# read, not a tokenization of all of it.
CHARS_PER_TOKEN = 32
LINE_BYTES_PER_CHAR = 12
LINE_BYTES_SLACK = 1 << 20


def record_char_limit(max_tokens: int) -> int:
    """The most characters a record's text may hold for ``data.max_tokens`` (checked before
    tokenizing)."""
    return max_tokens * CHARS_PER_TOKEN


def line_byte_limit(max_tokens: int) -> int:
    """The most bytes a JSONL line may hold for ``data.max_tokens`` (checked before parsing)."""
    return record_char_limit(max_tokens) * LINE_BYTES_PER_CHAR + LINE_BYTES_SLACK



# data.format: "auto" detects per record (below); the others force one format for every record.
FORMATS = ("auto", "messages", "prompt_completion", "alpaca", "sharegpt", "text")
ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speaker names (from/value), the aliases FastChat / Axolotl / LLaMA-Factory accept
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
                  "bing": "assistant", "model": "assistant", "tool": "tool"}


# data.columns: the keys a record's own keys may be mapped onto (data.columns.prompt=question
# reads a record's 'question' as its 'prompt'), applied before its format is detected
COLUMNS = ("messages", "conversations", "prompt", "completion", "instruction", "input", "output", "text")


def map_columns(rec, columns: dict):
    """``rec`` with its keys renamed by ``columns`` ({key data=jsonl reads: the record's key});
    a record without a mapped key keeps its keys (its format is then detected as usual)."""
    if not columns or not isinstance(rec, dict):
        return rec
    theirs = set(columns.values())
    out = {k: v for k, v in rec.items() if k not in theirs}
    for ours, key in columns.items():
        if key in rec:
            out[ours] = rec[key]
    return out


def columns_hint(keys) -> str:
    """The data.columns overrides that map a record of ``keys`` onto a format data=jsonl reads."""
    keys = [str(k) for k in keys]
    if len(keys) == 2:
        return f"data.columns.prompt={keys[0]} data.columns.completion={keys[1]}"
    if len(keys) == 1:
        return f"data.columns.text={keys[0]}"
    return "data.columns.prompt=<its prompt's key> data.columns.completion=<its reply's key>"


def _detect(rec) -> Optional[str]:
    """The record's format from its keys, as TRL detects a dataset's: messages,
    conversations (ShareGPT), prompt + completion, instruction + output (Alpaca), text."""
    if "messages" in rec:
        return "messages"
    if "conversations" in rec:
        return "sharegpt"
    if "prompt" in rec and "completion" in rec:
        return "prompt_completion"
    if "instruction" in rec and "output" in rec:
        return "alpaca"
    if "text" in rec:
        return "text"
    return None


def _checked_messages(msgs, where: str):
    if not isinstance(msgs, list) or not msgs:
        return None, ("bad_fields", f"'{where}' must be a non-empty list of messages")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None, ("bad_fields", f"{where}[{j}] needs string 'role' and 'content'")
        if m["role"] not in ROLES:
            return None, ("unknown_role", f"{where}[{j}] has the unknown role {m['role']!r} (roles: "
                          f"{', '.join(ROLES)}); a misspelled role would train as context")
    return msgs, None


def _normalise(rec, fmt: str):
    """(kind, payload, None) of a well-formed record of format ``fmt``, else (None, None, reason).
    kind "chat": payload = the messages (loss on assistant turns); "pc": (prompt, completion)
    strings (loss on the completion + EOS); "text": the text (loss on every token)."""
    if fmt == "messages":
        msgs, why = _checked_messages(rec.get("messages"), "messages")
    elif fmt == "sharegpt":
        conv = rec.get("conversations")
        if not isinstance(conv, list) or not conv:
            return None, None, ("bad_fields", "'conversations' must be a non-empty list")
        msgs = []
        for j, turn in enumerate(conv):
            if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
                return None, None, ("bad_fields", f"conversations[{j}] needs string 'from' and 'value'")
            role = SHAREGPT_ROLES.get(turn["from"].lower())
            if role is None:
                return None, None, ("unknown_role", f"conversations[{j}] has the unknown speaker "
                                    f"{turn['from']!r} (known: {', '.join(sorted(SHAREGPT_ROLES))})")
            msgs.append({"role": role, "content": turn["value"]})
        why = None
    elif fmt == "alpaca":
        inst, out = rec.get("instruction"), rec.get("output")
        extra = "" if rec.get("input") is None else rec["input"]  # absent or null: no input
        if not all(isinstance(x, str) for x in (inst, extra, out)):
            return None, None, ("bad_fields", "alpaca records need string 'instruction' and 'output' "
                                "(and 'input' if given)")
        user = inst if not extra else f"{inst}\n\n{extra}"
        msgs, why = [{"role": "user", "content": user}, {"role": "assistant", "content": out}], None
    elif fmt == "prompt_completion":
        prompt, completion = rec.get("prompt"), rec.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion.strip():
                return None, None, ("no_loss_token", "an empty 'completion': nothing to learn but the "
                                    "EOS token")
            return "pc", (prompt, completion), None
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            return None, None, ("bad_fields", "'prompt' and 'completion' must both be strings or both "
                                "message lists")
        p, why = _checked_messages(prompt, "prompt")
        if why is None:
            c, why = _checked_messages(completion, "completion")
        if why is None and any(m["role"] == "assistant" for m in p):
            why = ("bad_fields", "prompt-completion message lists with assistant turns in the prompt: "
                   "only the completion may be trained; put the conversation in 'messages' instead")
        if why is None and any(m["role"] != "assistant" for m in c):
            why = ("bad_fields", "the completion message list must hold assistant turns only")
        msgs = None if why else p + c
    elif fmt == "text":
        text = rec.get("text")
        if not isinstance(text, str) or not text:
            return None, None, ("bad_fields", "'text' must be a non-empty string")
        return "text", text, None
    else:  # pragma: no cover - FORMATS is checked at parse
        raise ValueError(fmt)
    if why is not None:
        return None, None, why
    if not any(m["role"] == "assistant" for m in msgs):
        return None, None, ("no_assistant", "no assistant message (nothing to learn)")
    empty = [j for j, m in enumerate(msgs) if m["role"] == "assistant" and not m["content"].strip()]
    if empty:  # only the template's end-of-turn token would carry its loss
        return None, None, ("no_loss_token", f"an empty assistant reply (message {empty[0] + 1} of the "
                            "conversation): nothing to learn but the template's end-of-turn token")
    return "chat", msgs, None


# what data.format=auto reads, by the keys of a record (as _detect tells them apart)
ACCEPTED = ("'messages' (chat: a list of {\"role\", \"content\"}), 'conversations' (ShareGPT: "
            "{\"from\", \"value\"}), 'prompt' + 'completion', 'instruction' + 'output' (Alpaca, "
            "optional 'input') or 'text' (plain text)")


# how the log names each format
FORMAT_NAMES = {"messages": "chat messages", "sharegpt": "ShareGPT conversations",
                "prompt_completion": "prompt-completion", "alpaca": "Alpaca instruction/output",
                "text": "plain text"}


def formats_text(formats) -> str:
    """((format, records), ...) as the log names them: 'chat messages', or 'chat messages (300
    records), prompt-completion (100 records)' for a mix."""
    if len(formats) == 1:
        return FORMAT_NAMES.get(formats[0][0], formats[0][0])
    return ", ".join(f"{FORMAT_NAMES.get(f, f)} ({n} record{'s' if n != 1 else ''})"
                     for f, n in formats) or "none"


def keys_text(keys, limit: int = 8) -> str:
    """A record's keys as a message shows them, in the record's order ('question', 'answer'; at
    most ``limit``)."""
    keys = [str(k) for k in keys]
    shown = ", ".join(repr(k[:40]) for k in keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "") if keys else "none"


def record_format(rec, forced: str = "auto") -> Optional[str]:
    """The format of the record ``rec`` (a dict) under data.format ``forced`` (None: unknown)."""
    return forced if forced != "auto" else _detect(rec)


def _validate(rec, forced: str = "auto", family: Optional[str] = None):
    """(kind, payload, None) or (None, None, reason) for one parsed record (raises nothing).
    ``forced``: data.format; under "auto" the format is detected per record, and ``family``
    ("text" or "conversational", set by the file's first good record) keeps plain-text and
    conversational records from mixing silently."""
    if not isinstance(rec, dict):
        return None, None, ("not_an_object", "not a JSON object")
    fmt = record_format(rec, forced)
    if fmt is None:
        return None, None, ("unknown_format", "no 'messages' key (nor 'conversations', string or "
                            "message-list 'prompt' and 'completion', 'instruction' and 'output', or "
                            f"'text'; its keys: {keys_text(rec)}; map them with {columns_hint(list(rec))})")
    if forced == "auto" and family is not None and (fmt == "text") != (family == "text"):
        return None, None, ("mixed_format", f"a {fmt} record in a {family} file (the format of its "
                            "first record); set data.format to train one format")
    return _normalise(rec, fmt)



def _text_chars(kind: str, payload) -> int:
    """The characters of a validated record's text (what the tokenizer would read)."""
    if kind == "chat":
        return sum(len(m["content"]) for m in payload)
    if kind == "pc":
        return len(payload[0]) + len(payload[1])
    return len(payload)


def _too_long(max_tokens: int, chars: Optional[int] = None, line_bytes: Optional[int] = None) -> str:
    if line_bytes is not None:
        return (f"a line of {line_bytes} bytes, more than data.max_tokens={max_tokens} tokens can "
                f"hold (at most {line_byte_limit(max_tokens)} bytes a line; not parsed)")
    return (f"{chars} characters, more than data.max_tokens={max_tokens} tokens can hold (at most "
            f"{record_char_limit(max_tokens)} characters, {CHARS_PER_TOKEN} a token; not tokenized)")
