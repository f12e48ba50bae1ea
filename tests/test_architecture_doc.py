"""docs/architecture.md names every part of the package it maps: each package folder as
``name/``, each top-level module as ``name.py`` and each Hydra config group as
``configs/<group>/``, in backticks -- so a new folder, module or group cannot go in without a
place on the map."""

import os
import re
from pathlib import Path

import megatron_fastpath

PACKAGE = Path(megatron_fastpath.__file__).resolve().parent
DOC = PACKAGE.parent / "docs" / "architecture.md"


def expected_names(package: Path) -> list[str]:
    """What the page must name, in the spelling it uses."""
    folders = sorted(Path(d).relative_to(package).as_posix() + "/" for d, dirs, files in os.walk(package)
                     if "__init__.py" in files and Path(d) != package
                     and "__pycache__" not in Path(d).parts)
    modules = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    groups = sorted(f"configs/{p.name}/" for p in (package / "configs").iterdir() if p.is_dir())
    return folders + modules + groups


def missing_from(text: str, names: list[str]) -> list[str]:
    named = set(re.findall(r"`([^`\n]+)`", text))
    return [n for n in names if n not in named]


def test_the_architecture_page_names_every_package_folder_module_and_config_group():
    names = expected_names(PACKAGE)
    assert {"train/", "packed_seq/", "rules.py", "configs/model/", "configs/fp8/"} <= set(names)
    assert missing_from(DOC.read_text(encoding="utf-8"), names) == []


def test_the_check_sees_a_missing_mention():
    names = ["train/", "rules.py", "configs/model/"]
    assert missing_from("`train/` and `configs/model/`; rules.py unquoted, `rules.pyc`", names) == ["rules.py"]
