"""Import rules of the package, checked on its source: a private ``megatron.core`` /
``transformer_engine`` name (a module path or an imported name starting with ``_``) is imported
only inside ``megatron_fastpath/compat/``, the one place version-gated against the releases it
was read in; and the main job (``megatron_fastpath.train``) is on top: no module outside
``train/`` imports it."""

import ast
import os

import pytest

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


def train_package_imports_inside_train(sources) -> list[str]:
    """``train/__init__.py`` is the entry point (``main``) and the public names, on top of the
    loop (``train/loop.py``) and the rest of ``train/``: a module of ``train/`` imports its
    siblings (``megatron_fastpath.train.<module>``), never the package itself; only
    ``__main__.py`` does (``from megatron_fastpath.train import main``)."""
    train_dir = os.path.join(ROOT, "train")
    siblings = {fn[:-3] for fn in os.listdir(train_dir) if fn.endswith(".py")}
    hits = {}
    for rel, src in sources:
        if not rel.startswith("train" + os.sep) or rel in (os.path.join("train", "__init__.py"),
                                                          os.path.join("train", "__main__.py")):
            continue
        for node in ast.walk(ast.parse(src, rel)):
            if isinstance(node, ast.ImportFrom) and node.module == "megatron_fastpath.train" \
                    and any(a.name not in siblings for a in node.names):
                hits[f"{rel}:{node.lineno}"] = None
            elif isinstance(node, ast.Import) and any(a.name == "megatron_fastpath.train" for a in node.names):
                hits[f"{rel}:{node.lineno}"] = None
    return list(hits)


def test_only_the_entry_point_imports_the_train_package():
    assert train_package_imports_inside_train(package_sources()) == []
    sources = dict(package_sources())
    loop = {m for _, m in imports_of(sources[os.path.join("train", "__init__.py")], "__init__.py")}
    assert "megatron_fastpath.train.loop" in loop  # run / train come from the loop


def test_the_train_package_check_sees_a_planted_import():
    planted = [(os.path.join("train", "loop.py"), "from megatron_fastpath.train import run\n"),
               (os.path.join("train", "step.py"), "import megatron_fastpath.train\n"),
               (os.path.join("train", "job.py"), "from megatron_fastpath.train import config, step\n"),
               (os.path.join("train", "__main__.py"), "from megatron_fastpath.train import main\n")]
    assert train_package_imports_inside_train(planted) == [os.path.join("train", "loop.py") + ":1",
                                                           os.path.join("train", "step.py") + ":1"]


def hf_imports_in_train(sources) -> list[str]:
    """The main job picks its model and data through ``providers`` (``hf`` registers the
    Hugging Face pair): an import of ``megatron_fastpath.hf`` from ``train/`` is a violation."""
    hits = {f"{rel}:{line}": None for rel, src in sources if rel.startswith("train" + os.sep)
            for line, mod in imports_of(src, rel)
            if mod == "megatron_fastpath.hf" or mod.startswith("megatron_fastpath.hf.")}
    return list(hits)


def test_the_main_job_reaches_hugging_face_only_through_providers():
    assert hf_imports_in_train(package_sources()) == []
    sources = dict(package_sources())
    assert "megatron_fastpath.providers" in {m for _, m in imports_of(sources[os.path.join("train", "job.py")], "job.py")}


def test_the_provider_check_sees_a_planted_import():
    planted = [(os.path.join("train", "x.py"), "from megatron_fastpath.hf.provider import HFModel\n"),
               (os.path.join("train", "y.py"), "import megatron_fastpath.hf\n"),
               (os.path.join("providers", "ok.py"), "from megatron_fastpath.hf import provider\n")]
    assert hf_imports_in_train(planted) == [os.path.join("train", "x.py") + ":1",
                                            os.path.join("train", "y.py") + ":1"]


def test_providers_are_chosen_by_the_groups_key():
    from megatron_fastpath import providers

    assert providers.pop_provider_key({"num_layers": 2}, "model") == ("synthetic", {"num_layers": 2})
    assert providers.pop_provider_key({"provider": "hf", "path": "x"}, "model") == ("hf", {"path": "x"})
    assert providers.model_provider("hf").key == "hf"  # imported by name on first use
    assert providers.data_provider("jsonl").key == "jsonl"
    with pytest.raises(ValueError, match=r"model.provider='nope' is not a registered model provider; known: \['hf', 'synthetic'\]"):
        providers.model_provider("nope")


def module_name(rel: str) -> str:
    """The dotted name of the package file ``rel`` (a package's ``__init__.py``: the package)."""
    name = "megatron_fastpath." + rel[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def package_imports(rel: str, source: str) -> dict[str, int]:
    """{module name: line of its first import} of every module ``rel`` imports, wherever the
    import is written: at module level, inside a function or under ``if TYPE_CHECKING`` (a
    deferred import still ties the two modules together); relative imports resolved;
    ``from a import b`` gives a and a.b."""
    package = module_name(rel) if rel.endswith("__init__.py") else module_name(rel).rpartition(".")[0]
    deps = {}
    for node in ast.walk(ast.parse(source, rel)):
        if isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                parts = package.split(".")
                module = ".".join(parts[: len(parts) - node.level + 1] + ([module] if module else []))
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            deps[name] = min(deps.get(name, node.lineno), node.lineno)
    return deps


def cycle_imports(sources, cycle: list[str]) -> list[str]:
    """``file:line imports module`` of each import that ties ``cycle``'s modules together."""
    members = set(cycle)
    return [f"{rel}:{line} imports {dep}" for rel, src in sources if module_name(rel) in members
            for dep, line in sorted(package_imports(rel, src).items(), key=lambda kv: kv[1])
            if dep in members and dep != module_name(rel)]


def import_cycles(sources) -> list[list[str]]:
    """Cycles of imports between the package's modules, module-level and function-local alike;
    each cycle (a strongly connected component of the import graph) as its sorted module names."""
    sources = list(sources)
    known = {module_name(rel) for rel, _ in sources}
    graph = {}
    for rel, src in sources:
        name = module_name(rel)
        graph[name] = {d for d in package_imports(rel, src) if d in known and d != name}
    index, low, stack, cycles = {}, {}, [], []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while comp[-1:] != [v]:
                comp.append(stack.pop())
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle_in_the_package():
    sources = list(package_sources())
    cycles = import_cycles(sources)
    assert cycles == [], "\n".join(line for c in cycles for line in cycle_imports(sources, c))


def test_the_cycle_check_sees_a_planted_cycle():
    planted = [(os.path.join("providers", "__init__.py"), "from megatron_fastpath.providers import synthetic\n"),
               (os.path.join("providers", "synthetic.py"), "from megatron_fastpath.providers import ModelSource\n"),
               ("model.py", "def f():\n    from megatron_fastpath import providers\n")]
    assert import_cycles(planted) == [["megatron_fastpath.providers", "megatron_fastpath.providers.synthetic"]]


def test_the_cycle_check_sees_function_local_type_checking_and_relative_imports():
    planted = [("rules.py", "def rule(f):\n    from megatron_fastpath.fp8.config import check\n"),
               (os.path.join("fp8", "config.py"), "def check(names=None):\n    from megatron_fastpath.rules import NAMES\n"),
               (os.path.join("train", "history.py"),
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .logger import StepResult\n"),
               (os.path.join("train", "logger.py"), "from megatron_fastpath.train.history import RunHistory\n"),
               (os.path.join("train", "step.py"), "from . import logger\n")]
    assert import_cycles(planted) == [["megatron_fastpath.fp8.config", "megatron_fastpath.rules"],
                                      ["megatron_fastpath.train.history", "megatron_fastpath.train.logger"]]
    assert cycle_imports(planted, ["megatron_fastpath.train.history", "megatron_fastpath.train.logger"]) == [
        os.path.join("train", "history.py") + ":3 imports megatron_fastpath.train.logger",
        os.path.join("train", "logger.py") + ":1 imports megatron_fastpath.train.history"]


# ------------------------------------------------------------------------------------------------
# The test suite: a package (``tests.*``), helpers in tests/support or beside their tests, never
# another test module, and no code of its own that edits the import path
# ------------------------------------------------------------------------------------------------
TESTS = os.path.dirname(os.path.abspath(__file__))


def suite_import_problems(source: str, filename: str) -> list[str]:
    problems = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append"):
            problems.append(f"{filename}:{node.lineno} edits sys.path")
    for lineno, module in imports_of(source, filename):
        if module.rsplit(".", 1)[-1].startswith("test_"):
            problems.append(f"{filename}:{lineno} imports the test module {module}")
    return problems


def suite_sources():
    for dirpath, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for fn in sorted(files):
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                with open(path) as f:
                    yield os.path.relpath(path, TESTS), f.read()


def test_tests_import_helpers_not_test_modules_and_leave_sys_path_alone():
    problems = [p for name, src in suite_sources() for p in suite_import_problems(src, name)]
    assert not problems, "\n".join(problems)
    missing = [os.path.relpath(d, TESTS) for d, dirs, files in os.walk(TESTS)
               if "__pycache__" not in d and any(f.endswith(".py") for f in files)
               and "__init__.py" not in files]
    assert not missing, f"test folders that are not packages: {missing}"


def test_the_suite_check_sees_each_planted_form():
    planted = ("import sys\nsys.path.insert(0, 'x')\nfrom test_other import helper\n"
               "import tests.hf.test_hf_parity as p\n")
    assert suite_import_problems(planted, "t.py") == [
        "t.py:2 edits sys.path", "t.py:3 imports the test module test_other",
        "t.py:4 imports the test module tests.hf.test_hf_parity"]


# Modules under tests/ that run as a script but are no child process of a test: a person runs
# them.
SCRIPTS_OUTSIDE_WORKERS = {
    os.path.join("slurm", "slurm_cluster.py"): "a person's `up` / `down` of the local cluster (docs/slurm.md)",
    os.path.join("support", "standin_registry.py"): "writes docs/cuda-graphs.md's stand-in table",
}


def scripts_outside_workers(sources) -> list[str]:
    """Modules of the suite with a module-level ``if __name__ == "__main__":`` or a package's
    ``__main__.py`` (a child-process entry: torchrun / ``python -m`` / a path) outside
    ``tests/workers/``."""
    found = []
    for rel, src in sources:
        if rel.startswith("workers" + os.sep) or rel in SCRIPTS_OUTSIDE_WORKERS:
            continue
        if os.path.basename(rel) == "__main__.py":
            found.append(f"{rel}:1")
            continue
        for node in ast.parse(src, rel).body:
            if isinstance(node, ast.If) and ast.unparse(node.test) in ('__name__ == "__main__"',
                                                                      "__name__ == '__main__'"):
                found.append(f"{rel}:{node.lineno}")
    return found


def test_child_process_workers_live_in_tests_workers():
    assert scripts_outside_workers(suite_sources()) == []
    present = {rel for rel, _ in suite_sources()}
    assert set(SCRIPTS_OUTSIDE_WORKERS) <= present, set(SCRIPTS_OUTSIDE_WORKERS) - present


def test_the_workers_check_sees_a_planted_script():
    planted = [(os.path.join("train", "x_worker.py"), 'def f():\n    pass\n\nif __name__ == "__main__":\n    f()\n'),
               (os.path.join("workers", "y_worker.py"), 'if __name__ == "__main__":\n    pass\n'),
               (os.path.join("support", "z.py"), 'def g():\n    if __name__ == "__main__":\n        pass\n'),
               (os.path.join("train", "matrix", "__main__.py"), 'print("run")\n')]
    assert scripts_outside_workers(planted) == [os.path.join("train", "x_worker.py") + ":4",
                                                os.path.join("train", "matrix", "__main__.py") + ":1"]
