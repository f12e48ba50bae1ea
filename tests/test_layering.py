"""Import rules of the package, checked on its source: a private ``megatron.core`` /
``transformer_engine`` name (a module path or an imported name starting with ``_``) is imported
only inside ``megatron_fastpath/compat/``, the one place version-gated against the releases it
was read in; and the main job (``megatron_fastpath.train``) is on top: no module outside
``train/`` imports it."""

import ast
import os

import megatron_fastpath

ROOT = os.path.dirname(megatron_fastpath.__file__)
GUARDED = ("megatron", "transformer_engine")


def private_imports(source: str, filename: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] not in GUARDED:
                continue
            names = [a.name for a in node.names if a.name.startswith("_")]
            if names or any(p.startswith("_") for p in parts):
                found.append(f"{filename}:{node.lineno} from {node.module} import {', '.join(names) or '...'}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in GUARDED and any(p.startswith("_") for p in parts):
                    found.append(f"{filename}:{node.lineno} import {alias.name}")
    return found


def package_sources():
    for dirpath, _, files in os.walk(ROOT):
        for fn in sorted(files):
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                yield os.path.relpath(path, ROOT), open(path, encoding="utf-8").read()


def test_private_megatron_and_te_names_are_imported_only_in_compat():
    outside = [hit for rel, src in package_sources() if not rel.startswith("compat" + os.sep)
               for hit in private_imports(src, rel)]
    assert outside == []
    inside = [hit for rel, src in package_sources() if rel.startswith("compat" + os.sep)
              for hit in private_imports(src, rel)]
    assert inside, "compat/ imports Megatron's private names: the check above must see them"


def test_the_private_import_check_sees_each_form():
    planted = ("from megatron.core.transformer.cuda_graphs import _CudaGraphRunner\n"
               "from transformer_engine.pytorch._extra_state import load\n"
               "import megatron.core._private_mod\n"
               "from megatron.core.transformer import TransformerConfig\n"
               "from torch._C import _foo\n")
    assert [h.split(" ", 1)[0] for h in private_imports(planted, "x.py")] == ["x.py:1", "x.py:2", "x.py:3"]


def imports_of(source: str, filename: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``source`` (``from a.b import c`` gives a.b
    and a.b.c, so importing a submodule by name is seen)."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def train_imports_outside_train(sources) -> list[str]:
    hits = {f"{rel}:{line}": None for rel, src in sources if not rel.startswith("train" + os.sep)
            for line, mod in imports_of(src, rel)
            if mod == "megatron_fastpath.train" or mod.startswith("megatron_fastpath.train.")}
    return list(hits)  # one entry per import statement


def test_nothing_below_the_main_job_imports_it():
    assert train_imports_outside_train(package_sources()) == []


def test_the_layering_check_sees_a_planted_import():
    planted = [("hf/x.py", "from megatron_fastpath.train.step import forward\n"),
               ("moe/y.py", "import megatron_fastpath.train\n"),
               ("z.py", "from megatron_fastpath import train\n"),
               ("train/ok.py", "from megatron_fastpath.train.step import forward\n")]
    assert train_imports_outside_train(planted) == ["hf/x.py:1", "moe/y.py:1", "z.py:1"]
