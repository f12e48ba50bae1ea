"""Write the small chat dataset shipped in examples/data/arith_chat.jsonl (deterministic).

Arithmetic and unit-conversion dialogues: single- and multi-turn, some with a system message,
plus a few prompt/completion records. Every answer is computed here, so the data is correct and
learnable (the answer depends on the numbers in the question).

    python examples/make_chat_jsonl.py [out.jsonl] [num_records]
"""

from __future__ import annotations

import json
import random
import sys

SYSTEMS = ["You are a careful calculator.", "Answer with the result only, briefly.",
           "You convert units and do arithmetic."]
UNITS = [("km", "m", 1000), ("m", "cm", 100), ("kg", "g", 1000), ("h", "min", 60),
         ("min", "s", 60), ("L", "mL", 1000)]
OPS = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]


def arithmetic(rng):
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    sym, fn = rng.choice(OPS)
    q = rng.choice([f"What is {a} {sym} {b}?", f"Compute {a} {sym} {b}.", f"{a} {sym} {b} = ?"])
    return q, f"{a} {sym} {b} = {fn(a, b)}.", fn(a, b)


def conversion(rng):
    src, dst, k = rng.choice(UNITS)
    n = rng.randint(1, 30)
    q = rng.choice([f"Convert {n} {src} to {dst}.", f"How many {dst} are in {n} {src}?"])
    return q, f"{n} {src} = {n * k} {dst}.", None


def record(rng):
    kind = rng.random()
    if kind < 0.08:  # prompt / completion
        q, a, _ = arithmetic(rng)
        return {"prompt": f"Question: {q}\nAnswer:", "completion": f" {a}"}
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    q, a, value = arithmetic(rng) if rng.random() < 0.6 else conversion(rng)
    msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if value is not None and rng.random() < 0.35:  # a follow-up turn on the previous result
        c = rng.randint(2, 20)
        msgs += [{"role": "user", "content": f"And plus {c}?"},
                 {"role": "assistant", "content": f"{value} + {c} = {value + c}."}]
    return {"messages": msgs}


def main(out: str = "examples/data/arith_chat.jsonl", n: int = 400) -> None:
    rng = random.Random(12)
    with open(out, "w", encoding="utf-8") as f:
        for _ in range(n):
            f.write(json.dumps(record(rng)) + "\n")
    print(f"wrote {n} records to {out}")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or []), *(int(x) for x in sys.argv[2:3]))
