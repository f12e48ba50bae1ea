"""CHANGELOG.md goes by version and date (Keep a Changelog): every second-level heading is
``## [X.Y.Z] - YYYY-MM-DD``, versions strictly decreasing and dates non-increasing down the
file, each version holds only ``### Added`` / ``### Changed`` / ``### Fixed`` / ``### Removed``
subsections (at least one), the top version is setup.py's, and no line speaks of sessions."""

import datetime
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERSION_HEADING = re.compile(r"## \[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d{2}-\d{2})")
SUBSECTIONS = ("Added", "Changed", "Fixed", "Removed")


def setup_version(setup_py: str) -> str:
    found = re.findall(r'^\s*version="([^"]+)",', setup_py, re.M)
    assert len(found) == 1, f"setup.py names its version {len(found)} times"
    return found[0]


def changelog_problems(text: str, version: str) -> list[str]:
    """What in a CHANGELOG's text breaks the rules above ([] when none); ``version`` is
    setup.py's."""
    problems = []
    versions = []  # (version tuple, date, line number)
    subsections = {}  # line number of a version heading -> its subsection names
    current = None
    for number, line in enumerate(text.splitlines(), start=1):
        if "session" in line.lower():
            problems.append(f"line {number} says 'session': {line.strip()!r}")
        if line.startswith("## "):
            match = VERSION_HEADING.fullmatch(line.rstrip())
            if match is None:
                problems.append(f"line {number}: second-level heading {line.strip()!r} is "
                                "not '## [X.Y.Z] - YYYY-MM-DD'")
                current = None
                continue
            try:
                date = datetime.date.fromisoformat(match.group(4))
            except ValueError:
                problems.append(f"line {number}: {match.group(4)!r} is not a date")
                current = None
                continue
            versions.append((tuple(int(g) for g in match.group(1, 2, 3)), date, number))
            current = number
            subsections[current] = []
        elif line.startswith("### "):
            name = line[4:].strip()
            if current is None:
                problems.append(f"line {number}: {line.strip()!r} is under no version heading")
            elif name not in SUBSECTIONS:
                problems.append(f"line {number}: subsection {name!r} is not one of "
                                f"{', '.join(SUBSECTIONS)}")
            elif name in subsections[current]:
                problems.append(f"line {number}: a second {name!r} subsection in one version")
            else:
                subsections[current].append(name)
        elif line.strip() and current is not None and not subsections[current]:
            problems.append(f"line {number}: text between a version heading and its first "
                            "subsection")
    for number, names in subsections.items():
        if not names:
            problems.append(f"line {number}: version without an Added / Changed / Fixed / "
                            "Removed subsection")
    for (above, above_date, _), (below, below_date, number) in zip(versions, versions[1:]):
        if not below < above:
            problems.append(f"line {number}: version {'.'.join(map(str, below))} is not below "
                            f"the one above it ({'.'.join(map(str, above))})")
        if below_date > above_date:
            problems.append(f"line {number}: date {below_date} is after the one above it "
                            f"({above_date})")
    if not versions:
        problems.append("no version heading")
    elif ".".join(map(str, versions[0][0])) != version:
        problems.append(f"top version {'.'.join(map(str, versions[0][0]))} is not setup.py's "
                        f"{version}")
    return problems


def test_changelog_goes_by_version_and_date():
    version = setup_version((REPO / "setup.py").read_text(encoding="utf-8"))
    text = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    assert changelog_problems(text, version) == []


GOOD = """# Changelog

## [0.2.0] - 2026-11-22

### Added

- A thing.

### Fixed

- Another.

## [0.1.0] - 2026-11-22

### Changed

- First.
"""


def test_a_well_formed_changelog_has_no_problems():
    assert changelog_problems(GOOD, "0.2.0") == []


def test_each_rule_is_enforced():
    assert changelog_problems(GOOD, "0.3.0") == [
        "top version 0.2.0 is not setup.py's 0.3.0"]
    assert changelog_problems(GOOD.replace("## [0.1.0]", "## [0.2.0]"), "0.2.0") == [
        "line 13: version 0.2.0 is not below the one above it (0.2.0)"]
    assert changelog_problems(GOOD.replace("2026-11-22\n\n### Changed", "2026-11-23\n\n"
                                           "### Changed"), "0.2.0") == [
        "line 13: date 2026-11-23 is after the one above it (2026-11-22)"]
    assert changelog_problems(GOOD.replace("### Fixed", "### Notes"), "0.2.0") == [
        "line 9: subsection 'Notes' is not one of Added, Changed, Fixed, Removed"]
    assert changelog_problems(GOOD.replace("### Changed\n", ""), "0.2.0") == [
        "line 16: text between a version heading and its first subsection",
        "line 13: version without an Added / Changed / Fixed / Removed subsection"]
    assert changelog_problems(GOOD.replace("- First.", "- First working Session."),
                              "0.2.0") == [
        "line 17 says 'session': '- First working Session.'"]
    assert changelog_problems(GOOD.replace("## [0.1.0] - 2026-11-22", "## Session 1"),
                              "0.2.0") == [
        "line 13 says 'session': '## Session 1'",
        "line 13: second-level heading '## Session 1' is not '## [X.Y.Z] - YYYY-MM-DD'",
        "line 15: '### Changed' is under no version heading"]
    assert changelog_problems(GOOD.replace("2026-11-22", "2026-11-31", 1), "0.2.0") == [
        "line 3: '2026-11-31' is not a date",
        "line 5: '### Added' is under no version heading",
        "line 9: '### Fixed' is under no version heading",
        "top version 0.1.0 is not setup.py's 0.2.0"]
