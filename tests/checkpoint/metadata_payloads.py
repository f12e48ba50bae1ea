"""Crafted ``.metadata`` files that cost resources or are malformed (hand-written opcodes).

The code-execution and traversal payloads are ``test_unpickling_safety.payloads``; these are
the ones that try to crash, hang or exhaust the checker (or the C unpickler after it)."""

import pickle
import struct

from tests.checkpoint.pickle_payloads import _call, _p4, _real_metadata, _s, _stack_global

META = "torch.distributed.checkpoint.metadata"
MEMOIZE, STOP = b"\x94", b"."


def _u(text: str) -> bytes:  # BINUNICODE (4-byte length)
    b = text.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _get(i: int) -> bytes:
    return b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i)


def deep_tuple(depth: int) -> bytes:
    """() wrapped in ``depth`` 1-tuples (one TUPLE1 byte per level)."""
    return b")" + b"\x85" * depth


def dag(levels: int) -> bytes:
    """t0 = (); t_i = (t_{i-1}, t_{i-1}): ``levels`` memoized tuples, 2**levels leaves; pushes
    t_levels only (memo slots 0..levels)."""
    out = b")" + MEMOIZE + b"0"
    for i in range(1, levels + 1):
        out += _get(i - 1) + _get(i - 1) + b"\x86" + MEMOIZE + b"0"
    return out + _get(levels)


def as_dict_key(key: bytes) -> bytes:
    return _p4(b"}" + key + b"N" + b"s")


def deep_tuple_key() -> bytes:
    """A 10**6-deep tuple as a dict key (1 MB): hashing it recurses 10**6 levels in C."""
    return as_dict_key(deep_tuple(10**6))


def dag_key(levels: int = 80) -> bytes:
    return as_dict_key(dag(levels))


def dag_callable(levels: int = 80) -> bytes:
    """The DAG as what REDUCE calls (a refusal that printed it would never finish)."""
    return _p4(dag(levels) + b")" + b"R")


def frozenset_copies(n_items: int = 2000, size: int = 105_000, cls: str = "frozenset") -> bytes:
    """frozenset(S) (or ``cls``) for one memoized set S of ``n_items`` ints, repeated until the
    file is ``size`` bytes; each 6-byte repetition builds a new copy of S."""
    out = b"\x80\x04]" + MEMOIZE  # the list the copies go to (memo 0)
    out += b"\x8f(" + b"".join(b"M" + struct.pack("<H", i) for i in range(n_items)) + b"\x90"
    out += b"\x85" + MEMOIZE + b"0"  # (S,) in memo 1
    out += _stack_global("builtins", cls) + MEMOIZE + b"0"  # memo 2
    rep = _get(2) + _get(1) + b"R" + b"a"
    return out + rep * ((size - len(out)) // len(rep)) + STOP


def metadata_with_long_binput(index: int) -> bytes:
    """A real protocol-2 metadata that first stores None at memo slot ``index``."""
    meta, _ = _real_metadata()
    data = pickle.dumps(meta, protocol=2)
    assert data[:2] == b"\x80\x02"
    return data[:2] + b"N" + b"r" + struct.pack("<I", index) + b"0" + data[2:]


def late_deep_lists(n: int = 1000) -> bytes:
    """n lists, then L_i.append(L_{i+1}) in order: each list is 1 deep when it is appended,
    the chain ends n deep."""
    out = b"\x80\x04" + (b"]" + MEMOIZE + b"0") * n
    for i in range(n - 1):
        out += _get(i) + _get(i + 1) + b"a" + b"0"
    return out + _get(0) + STOP


def _long1(v: int) -> bytes:
    b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(b)]) + b


def int_key_flood(n: int = 30_000) -> bytes:
    """A dict of n int keys with one hash (k * (2**61 - 1) all hash to 0): n**2 / 2 probes."""
    return b"\x80\x04}(" + b"".join(_long1(k * (2**61 - 1)) + b"N" for k in range(1, n + 1)) + b"u" + STOP


def tuple_key_flood(n: int = 20_000) -> bytes:
    """The same flood with keys (k * (2**61 - 1),): a tuple hashes its elements' hashes."""
    return (b"\x80\x04}(" + b"".join(_long1(k * (2**61 - 1)) + b"\x85N" for k in range(1, n + 1))
            + b"u" + STOP)


def metadata_index_key_flood(n: int = 20_000) -> bytes:
    """MetadataIndex keys whose fqn is k * (2**61 - 1) (set by BUILD): they hash as (fqn, offset)."""
    head = b"\x80\x04}" + _stack_global(META, "MetadataIndex") + MEMOIZE + b"0("
    key = lambda k: _get(0) + b")\x81}" + _s("fqn") + _long1(k * (2**61 - 1)) + b"sb"  # noqa: E731
    return head + b"".join(key(k) + b"N" for k in range(1, n + 1)) + b"u" + STOP


def resource_payloads() -> dict:
    big = 1 << 26
    return {
        "deep-tuple-as-key": deep_tuple_key(),
        "deep-tuple-as-value": _p4(b"]" + deep_tuple(10**6) + b"a"),
        "deep-lists-appended-late": late_deep_lists(),
        "dag-as-key": dag_key(),
        "dag-as-reduce-callable": dag_callable(),
        "dag-in-frozenset": _p4(b"(" + dag(80) + b"\x91"),
        "dag-as-enum-argument": _p4(_stack_global(META, "_MEM_FORMAT_ENCODING") + dag(80) + b"\x85R"),
        "dag-as-value": _p4(b"]" + dag(80) + b"a"),
        "frozenset-copies": frozenset_copies(),
        "set-copies": frozenset_copies(cls="set"),
        "long-binput-2**26": metadata_with_long_binput(big),
        "long-binput-2**31-1": metadata_with_long_binput(2**31 - 1),
        "binput-past-the-memo": b"\x80\x02Nq\x05.",
        "proto0-put-2**26": b"Np67108864\n.",
        "proto0-put-negative": b"Np-1\n.",
        "int-key-flood": int_key_flood(),
        "tuple-key-flood": tuple_key_flood(),
        "metadata-index-key-flood": metadata_index_key_flood(),
        "many-marks": b"(" * 10**6 + b"N.",
        "wide-stack": b"N" * 10**6 + b".",
        "an-object-per-byte": b"\x80\x04" + b"]" * 200_000 + b".",
        "a-dict-per-byte-in-a-list": b"\x80\x04](" + b"}" * 200_000 + b"e.",
    }


def malformed_payloads() -> dict:
    meta, _ = _real_metadata()
    real = pickle.dumps(meta, protocol=4)
    huge = lambda op, fmt, n: b"\x80\x04" + op + struct.pack(fmt, n) + b"abc."  # noqa: E731
    return {
        "empty": b"",
        "proto-only": b"\x80\x04",
        "truncated-at-10": real[:10],
        "truncated-at-half": real[: len(real) // 2],
        "truncated-before-stop": real[:-1],
        "bad-opcode": b"\x80\x04\xff.",
        "protocol-6": b"\x80\x06N.",
        "protocol-255": b"\x80\xffN.",
        "no-stop": b"\x80\x04N",
        "binbytes-2**31": huge(b"B", "<I", 2**31),
        "binbytes8-2**40": huge(b"\x8e", "<Q", 2**40),
        "binunicode-2**31": huge(b"X", "<I", 2**31),
        "binunicode8-2**62": huge(b"\x8d", "<Q", 2**62),
        "binstring-2**31": b"\x80\x02T" + struct.pack("<I", 2**31) + b"abc.",
        "long4-2**31": huge(b"\x8b", "<I", 2**31),
        "bytearray8-2**40": b"\x80\x05\x96" + struct.pack("<Q", 2**40) + b"abc.",
        "frame-2**40": huge(b"\x95", "<Q", 2**40),
        "invalid-utf8": b"\x80\x04\x8c\x02\xff\xfe.",
        "reduce-on-empty-stack": b"\x80\x04R.",
        "stop-on-empty-stack": b"\x80\x04.",
        "pop-mark-without-mark": b"\x80\x041N.",
        "get-never-stored": b"\x80\x02h\x07.",
        "odd-dict": b"\x80\x02(NNNd.",
        "append-to-a-str": _p4(_s("x") + b"Na"),
        "next-buffer": b"\x80\x05\x97.",
        "readonly-buffer": b"\x80\x05N\x98.",
        "decimal-long-5000-digits": b"L" + b"9" * 5000 + b"L\n.",
        "global-name-with-newlines": _p4(_call(_u("posix\n" * 2000) + _s("system") + b"\x93")),
        "stack-global-of-ints": b"\x80\x04K\x01K\x02\x93.",
        "text-file": b"hello world\n",
        "json-file": b'{"state_dict_metadata": {}}',
        "zip-header": b"PK\x03\x04" + b"\x00" * 26,
        "a-plain-dict": pickle.dumps({"state_dict_metadata": {}}),
    }
