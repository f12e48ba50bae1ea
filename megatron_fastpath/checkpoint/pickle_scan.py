"""A bounded walk over a pickle's opcodes, before anything in it is built.

:func:`scan` reads the opcodes (``pickletools.genops`` over the bytes in memory, so a declared
length can never make it allocate more than the file holds) and runs them on an *abstract*
stack: scalars are the decoded values, every container or instance is a :class:`_Node` that
records only its children, its nesting depth and how many objects it expands to when every
shared reference is followed (what hashing, comparing or printing it walks). Nothing the file
describes is built or printed here; only hash keys get plain stand-ins (tuples of scalars,
within the work bound) to find colliding hashes. Each opcode is checked as it comes:

* the stream: a known opcode, a supported protocol, frames and declared lengths within the
  file, no stack underflow, a ``STOP``; memo indices are dense (a ``PUT`` names a stored slot or
  the next free one, a ``GET`` a stored one), so no unpickler sizes its memo from the file;
  APPEND, SETITEM and ADDITEMS add to lists, dicts and sets only;
* globals go through ``resolve`` (the caller's allow-list) and every calling opcode (REDUCE,
  NEWOBJ, NEWOBJ_EX, OBJ, INST) calls a class it returned, or one of ``functions`` with one
  argument of the listed type; BUILD sets the state of such an instance, once; persistent ids,
  the copyreg extension registry and out-of-band buffers are refused;
* resources, all bounded by the file's size ``S``: nesting depth and marks open at once
  (:data:`MAX_DEPTH`); the objects and references built (``4 S + 65536``, which also bounds what
  calls copy, e.g. ``frozenset(s)`` repeated); the objects hashed or passed to a call, summed
  over the file and counted as expanded (``64 S + 2**20``: a tuple DAG that shares its halves
  expands exponentially), with the comparisons that keys of equal hash cost in one dict or set
  (stand-ins hash as ints, tuples, frozensets, torch.Size and MetadataIndex do in this process,
  which unpickles the file next with the same hash seed).

A refusal is a :class:`Refusal` carrying one line: what the file asks for and why it is refused.
"""

from __future__ import annotations

import io
import pickle
import pickletools

MAX_DEPTH = 100


class Refusal(Exception):
    """The pickle is refused; ``kind`` is ``unsafe`` (it would call or reach something not
    allowed), ``malformed`` (not a valid pickle) or ``resource`` (over a bound)."""

    def __init__(self, kind: str, what: str):
        super().__init__(what)
        self.kind, self.what = kind, what


def clip(text: str, limit: int = 120) -> str:
    """``text`` as one printable line of at most about ``limit`` characters."""
    short = text[:limit].encode("unicode_escape").decode("ascii")
    return short + ("..." if len(text) > limit else "")


class _Global:
    __slots__ = ("obj", "label")

    def __init__(self, obj, label: str):
        self.obj, self.label = obj, label


class _Node:
    """A container or instance the pickle would build: its children (for dicts, keys and values
    alternating), its depth and expanded size (lower bounds until :meth:`_Scan.finish`)."""

    __slots__ = ("kind", "cls", "kids", "depth", "size", "hashes", "built", "fields", "walk", "stand_in")

    def __init__(self, kind: str, cls=None):
        self.kind, self.cls, self.kids = kind, cls, ()  # a list once it has children
        self.depth, self.size, self.hashes, self.built, self.walk = 1, 1, None, False, 0
        self.stand_in = None  # (plain value,) once computed, for a tuple or frozenset
        self.fields = None  # an instance's attributes, where its hash depends on them


def describe(v) -> str:
    """What an abstract value is, by type and size; never its contents."""
    if isinstance(v, _Node):
        what = v.cls.__qualname__ if v.kind == "inst" else v.kind
        return f"a {what} of {len(v.kids)} items"
    if isinstance(v, _Global):
        return v.label
    if isinstance(v, (str, bytes, bytearray)):
        return f"a {type(v).__name__} of length {len(v)}"
    return f"a {type(v).__name__}"


_STR = (str, bytes, bytearray)
_UNKNOWN = object()


class _Scan:
    def __init__(self, data: bytes, resolve, functions: dict):
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        self.data, self.resolve, self.functions = data, resolve, functions
        # instances whose hash is their fields' (dataclass(frozen=True)) or a tuple's
        self.field_hashed = {MetadataIndex: ("fqn", "offset")}
        self.tuple_hashed = (torch.Size,)
        n = len(data)
        self.mem_limit = 4 * n + 65536
        self.work_limit = 64 * n + (1 << 20)
        self.mem = self.work = self.proto = 0
        self.stack: list = []
        self.marks: list = []
        self.memo: list = []
        self.nodes: list = []
        self.events: list = []  # nodes hashed, compared or printed while the file is loaded

    # -- accounting ------------------------------------------------------------------------
    def charge(self, units: int) -> None:
        self.mem += units
        if self.mem > self.mem_limit:
            raise Refusal("resource", f"build more than {self.mem_limit} objects and references "
                                      f"(the bound for a file of {len(self.data)} bytes)")

    def grow(self, node: _Node, kids) -> None:
        """Add ``kids`` to ``node`` (charged), keeping depth and size bounds up to date."""
        kids = list(kids)
        if not kids:
            return
        self.charge(len(kids))
        if node.kids == ():
            node.kids = kids
        else:
            node.kids += kids
        for k in kids:
            if isinstance(k, _Node):
                node.depth = max(node.depth, k.depth + 1)
                node.size += k.size
            else:
                node.size += 1
        if node.depth > MAX_DEPTH:
            raise Refusal("resource", f"nest containers deeper than {MAX_DEPTH} levels")
        if node.size > self.work_limit:
            raise Refusal("resource", f"hold a structure that expands to more than "
                                      f"{self.work_limit} objects (shared references followed)")

    def new(self, kind: str, kids=(), cls=None) -> _Node:
        node = _Node(kind, cls)
        self.charge(1)
        self.nodes.append(node)
        if kids:
            self.grow(node, kids)
        return node

    def hashed(self, container: _Node, keys) -> None:
        """``keys`` are hashed into ``container``: each is an event, and a key whose hash an
        earlier key of the container shares costs one comparison per such key (a flood of
        equal hashes is quadratic). Hashes are computed on :meth:`plain` stand-ins: this
        process unpickles the file next, with the same hash seed."""
        for k in keys:
            if isinstance(k, _Node):
                self.events.append(k)
            before = self.work
            plain = self.plain(k, 0)
            cost = max(1, self.work - before)
            if plain is _UNKNOWN:
                continue
            try:
                h = hash(plain)
            except TypeError:
                continue  # unhashable: the unpickler fails here
            if container.hashes is None:
                container.hashes = {}
            n = container.hashes.get(h, 0)
            container.hashes[h] = n + 1
            self.work += n * cost
        self.check_work()

    def plain(self, v, depth: int):
        """A plain value hashing and comparing as ``v`` will once built (tuples of scalars,
        frozensets, torch.Size, MetadataIndex), else ``_UNKNOWN`` (an instance hashed by
        identity or salted by a str, or an unhashable container). Each node visited is work."""
        if not isinstance(v, _Node):
            return v.obj if isinstance(v, _Global) else v
        self.work += 1
        self.check_work()
        if depth > MAX_DEPTH:
            raise Refusal("resource", f"nest containers deeper than {MAX_DEPTH} levels")
        if v.kind in ("tuple", "frozenset"):  # built once: rebuilding a frozenset of equal
            if v.stand_in is None:            # hashes would repeat its quadratic cost
                out = [self.plain(k, depth + 1) for k in v.kids]
                try:
                    value = _UNKNOWN if any(x is _UNKNOWN for x in out) else (
                        tuple(out) if v.kind == "tuple" else frozenset(out))
                except TypeError:  # an unhashable element
                    value = _UNKNOWN
                v.stand_in = (value,)
            return v.stand_in[0]
        if v.kind == "inst" and v.cls in self.tuple_hashed:  # torch.Size(seq) hashes as a tuple
            return self.as_tuple(v.kids[0], depth + 1) if v.kids else ()
        if v.kind == "inst" and v.cls in self.field_hashed:
            fields = v.fields or {}
            # MetadataIndex.__init__ turns offset into a torch.Size
            out = tuple(self.as_tuple(fields[f], depth + 1) if f == "offset" and isinstance(fields.get(f), _Node)
                        else self.plain(fields.get(f), depth + 1) for f in self.field_hashed[v.cls])
            return _UNKNOWN if any(x is _UNKNOWN for x in out) else out
        return _UNKNOWN

    def as_tuple(self, v, depth: int):
        """:meth:`plain` of ``tuple(v)`` for a tuple, list or torch.Size ``v``."""
        if isinstance(v, _Node) and v.kind == "list":
            self.work += 1
            out = tuple(self.plain(k, depth + 1) for k in v.kids)
            return _UNKNOWN if any(x is _UNKNOWN for x in out) else out
        out = self.plain(v, depth)
        return out if type(out) is tuple else _UNKNOWN

    def check_work(self) -> None:
        if self.work > self.work_limit:
            raise Refusal("resource", f"hash or pass to calls more than {self.work_limit} objects "
                                      f"(the bound for a file of {len(self.data)} bytes)")

    # -- stack -----------------------------------------------------------------------------
    def pop(self, n: int = 1) -> list:
        if len(self.stack) < n:
            raise Refusal("malformed", "it pops more values than the unpickling stack holds")
        out = self.stack[len(self.stack) - n:]
        del self.stack[len(self.stack) - n:]
        return out

    def pop_mark(self) -> list:
        if not self.marks:
            raise Refusal("malformed", "it pops a mark that was never set")
        items, self.stack = self.stack, self.marks.pop()
        return items

    def target(self, op: str, kind: str, base: type) -> _Node:
        """The top of the stack, which ``op`` adds to: a ``kind`` or an instance of a
        ``base`` subclass (tuples and frozensets never change once built)."""
        if not self.stack:
            raise Refusal("malformed", f"it applies {op} to an empty stack")
        v = self.stack[-1]
        if not (isinstance(v, _Node) and (v.kind == kind or v.kind == "inst" and issubclass(v.cls, base))):
            raise Refusal("malformed", f"it applies {op} to {describe(v)}")
        return v

    # -- calls -----------------------------------------------------------------------------
    def call(self, func, args: list, op: str, kwargs=None) -> _Node:
        if isinstance(func, _Global) and func.obj in self.functions:
            kind = self.functions[func.obj]
            if not (len(args) == 1 and type(args[0]) is kind and kwargs is None and op == "REDUCE"):
                raise Refusal("unsafe", f"call {func.label} with ({', '.join(map(describe, args))}) "
                                        f"({op})")
            return self.new("value", args)
        if not (isinstance(func, _Global) and isinstance(func.obj, type)):
            raise Refusal("unsafe", f"call {describe(func)} ({op})")
        cls = func.obj
        # what a call may copy (set(s), torch.Size(t), OrderedDict(d)): charged, and hashed
        # when the class hashes its argument's items
        for a in args:
            if isinstance(a, _Node):
                self.charge(len(a.kids))
                self.events.append(a)
            elif isinstance(a, _STR):
                self.charge(len(a))
            else:
                self.work += 1
        if kwargs is not None:
            self.events.append(kwargs)
        inst = self.new("inst", args, cls)
        if cls in self.field_hashed and op in ("REDUCE", "OBJ", "INST"):  # __init__(*args)
            inst.fields = dict(zip(("fqn", "offset", "index"), args))
        if cls in (set, frozenset, dict) or issubclass(cls, dict):
            for a in args[:1]:
                if isinstance(a, _Node):
                    self.hashed(inst, a.kids[0::2] if a.kind == "dict" else a.kids)
        self.check_work()
        return inst

    def build(self) -> None:
        state, = self.pop()
        if not self.stack:
            raise Refusal("malformed", "it applies BUILD to an empty stack")
        inst = self.stack[-1]
        if not (isinstance(inst, _Node) and inst.kind == "inst") or inst.cls in (set, frozenset):
            raise Refusal("unsafe", f"set the state of {describe(inst)} (BUILD)")
        if inst.built:
            raise Refusal("malformed", f"it sets the state of {describe(inst)} twice (BUILD)")
        inst.built = True
        if not isinstance(state, _Node):
            self.work += 1
        elif getattr(inst.cls, "__setstate__", None) is not None:  # it may hash or print the state
            self.events.append(state)
        else:  # the keys of state (and slotstate) become attribute names
            parts = state.kids if state.kind == "tuple" and len(state.kids) == 2 else [state]
            for p in parts:
                if isinstance(p, _Node) and p.kind == "dict":
                    self.hashed(inst, p.kids[0::2])
                    inst.fields = inst.fields or {}
                    inst.fields.update((k, v) for k, v in zip(p.kids[0::2], p.kids[1::2]) if type(k) is str)
                elif isinstance(p, _Node):
                    self.events.append(p)
        self.grow(inst, [state])
        self.check_work()

    # -- the walk --------------------------------------------------------------------------
    def run(self) -> None:
        f = io.BytesIO(self.data)
        try:
            for opcode, arg, pos in pickletools.genops(f):
                if self.step(opcode.name, arg, pos or 0):
                    return
        except (ValueError, OverflowError, UnicodeError) as exc:
            raise Refusal("malformed", clip(str(exc))) from None
        raise Refusal("malformed", "it ends without a STOP opcode")

    def step(self, name: str, arg, pos: int):  # noqa: C901 - one branch per opcode family
        st = self.stack
        if name in _SCALARS:
            self.stack.append(_SCALARS[name] if arg is None else arg)
        elif name == "EMPTY_TUPLE":
            self.stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            self.stack.append(self.new("tuple", self.pop(int(name[-1]))))
        elif name == "TUPLE":
            items = self.pop_mark()
            self.stack.append(self.new("tuple", items))
        elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"):
            self.stack.append(self.new(_EMPTY[name]))
        elif name == "LIST":
            items = self.pop_mark()
            self.stack.append(self.new("list", items))
        elif name in ("DICT", "FROZENSET"):
            items = self.pop_mark()
            if name == "DICT" and len(items) % 2:
                raise Refusal("malformed", "it builds a dict from an odd number of items")
            node = self.new(name.lower(), items)
            self.hashed(node, items[0::2] if name == "DICT" else items)
            self.stack.append(node)
        elif name in ("APPEND", "APPENDS"):
            items = self.pop() if name == "APPEND" else self.pop_mark()
            self.grow(self.target(name, "list", list), items)
        elif name in ("SETITEM", "SETITEMS"):
            items = self.pop(2) if name == "SETITEM" else self.pop_mark()
            if len(items) % 2:
                raise Refusal("malformed", "it sets items from an odd number of values (SETITEMS)")
            target = self.target(name, "dict", dict)
            self.hashed(target, items[0::2])
            self.grow(target, items)
        elif name == "ADDITEMS":
            items = self.pop_mark()
            target = self.target(name, "set", set)
            self.hashed(target, items)
            self.grow(target, items)
        elif name == "POP":
            self.pop() if st else self.pop_mark()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            if not st:
                raise Refusal("malformed", "it applies DUP to an empty stack")
            self.stack.append(st[-1])
        elif name == "MARK":
            if len(self.marks) >= MAX_DEPTH:  # each open mark is a container being built
                raise Refusal("resource", f"open more than {MAX_DEPTH} marks at once")
            self.marks.append(st)
            self.stack = []
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if not 0 <= arg < len(self.memo):
                raise Refusal("malformed", f"it reads memo slot {arg}, which was never stored ({name})")
            self.stack.append(self.memo[arg])
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            idx = len(self.memo) if name == "MEMOIZE" else arg
            if not 0 <= idx <= len(self.memo):
                raise Refusal("resource", f"store memo slot {idx} after {len(self.memo)} slots "
                                          f"({name}; an unpickler would size its memo to it)")
            if not st:
                raise Refusal("malformed", f"it memoizes from an empty stack ({name})")
            self.charge(1)
            self.memo[idx:idx + 1] = [st[-1]]
        elif name in ("GLOBAL", "INST"):
            module, _, qual = arg.partition(" ")
            g = _Global(self.resolve(module, qual, self.proto), clip(f"{module}.{qual}"))
            value = g if name == "GLOBAL" else self.call(g, self.pop_mark(), "INST")
            self.stack.append(value)
        elif name == "STACK_GLOBAL":
            module, qual = self.pop(2)
            if type(module) is not str or type(qual) is not str:
                raise Refusal("malformed", "it names a global with non-string values (STACK_GLOBAL)")
            self.stack.append(_Global(self.resolve(module, qual, self.proto), clip(f"{module}.{qual}")))
        elif name == "REDUCE":
            func, args = self.pop(2)
            if not (args == () or isinstance(args, _Node) and args.kind == "tuple"):
                raise Refusal("malformed", f"it calls with {describe(args)} as arguments (REDUCE)")
            self.stack.append(self.call(func, [] if args == () else args.kids, "REDUCE"))
        elif name in ("NEWOBJ", "NEWOBJ_EX"):
            parts = self.pop(2 if name == "NEWOBJ" else 3)
            args = parts[1]
            if not (args == () or isinstance(args, _Node) and args.kind == "tuple"):
                raise Refusal("malformed", f"it calls with {describe(args)} as arguments ({name})")
            kwargs = parts[2] if name == "NEWOBJ_EX" else None
            if kwargs is not None and not (isinstance(kwargs, _Node) and kwargs.kind == "dict"):
                raise Refusal("malformed", f"it calls with {describe(kwargs)} as keywords ({name})")
            self.stack.append(self.call(parts[0], [] if args == () else args.kids, name, kwargs))
        elif name == "OBJ":
            items = self.pop_mark()
            if not items:
                raise Refusal("malformed", "it calls nothing (OBJ with an empty mark)")
            self.stack.append(self.call(items[0], items[1:], "OBJ"))
        elif name == "BUILD":
            self.build()
        elif name == "PROTO":
            if arg > pickle.HIGHEST_PROTOCOL:
                raise Refusal("malformed", f"it uses pickle protocol {arg} (this Python reads up to "
                                           f"{pickle.HIGHEST_PROTOCOL})")
            self.proto = arg
        elif name == "FRAME":
            if arg > len(self.data) - pos - 9:
                raise Refusal("malformed", f"it declares a frame of {arg} bytes with "
                                           f"{len(self.data) - pos - 9} left in the file")
        elif name == "STOP":
            (root,) = self.pop()
            self.finish(root)
            return True
        elif name in ("PERSID", "BINPERSID"):
            raise Refusal("unsafe", "resolve a persistent id")
        elif name in ("EXT1", "EXT2", "EXT4"):
            raise Refusal("unsafe", "call through the copyreg extension registry (EXT1/2/4)")
        else:  # NEXT_BUFFER, READONLY_BUFFER and anything newer
            raise Refusal("malformed", f"it uses {name}, which a checkpoint metadata file never holds")
        return False

    def finish(self, root) -> None:
        """Exact depth and expanded size of every node (children complete now, so the bounds
        kept while walking become exact), cycles refused; then the events and the root summed
        against the work bound. ``walk``: 0 not seen, 1 on the current path, 2 done."""
        limit = self.work_limit + 1
        for start in self.nodes:
            if start.walk:
                continue
            if not start.kids:  # size and depth 1 already
                start.walk = 2
                continue
            todo = [(start, False)]
            while todo:
                node, done = todo.pop()
                if done:
                    size, depth = 1, 1
                    for k in node.kids:
                        if isinstance(k, _Node):
                            size += k.size
                            depth = max(depth, k.depth + 1)
                        else:
                            size += 1
                    node.size, node.depth, node.walk = min(size, limit), depth, 2
                    if depth > MAX_DEPTH:
                        raise Refusal("resource", f"nest containers deeper than {MAX_DEPTH} levels")
                elif node.walk == 1:
                    raise Refusal("resource", "hold a reference cycle")
                elif node.walk == 0:
                    node.walk = 1
                    todo.append((node, True))
                    for k in node.kids:
                        if isinstance(k, _Node) and k.walk != 2:
                            if k.kids:
                                todo.append((k, False))
                            else:
                                k.walk = 2
        for n in self.events + ([root] if isinstance(root, _Node) else []):
            self.work += n.size
            self.check_work()


_EMPTY = {"EMPTY_LIST": "list", "EMPTY_DICT": "dict", "EMPTY_SET": "set"}
_SCALARS = {
    "NONE": None, "NEWTRUE": True, "NEWFALSE": False,
    **{n: None for n in ("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
                         "STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES",
                         "BINBYTES8", "BYTEARRAY8", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
                         "BINUNICODE8", "FLOAT", "BINFLOAT")},
}


def scan(data: bytes, resolve, functions: dict) -> None:
    """Walk ``data`` (a whole pickle) under the bounds above; :class:`Refusal` if any fails.
    ``resolve(module, name, protocol)`` returns an allowed global or raises; ``functions`` maps the
    allowed functions to the one argument type each takes."""
    _Scan(data, resolve, functions).run()
