"""docs/architecture.md's "One turn, file by file" stays true to the tree: every file it names
exists, the spine stays within 12 files, and no file is entered twice on the way out."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_SPINE_FILES = 12


def _section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("### One turn, file by file")
    end = text.index("\n## ", start)
    return text[start:end]


def _steps(part: str) -> list[str]:
    """The file each numbered step of the In or Out list names first."""
    block = _section().split(f"\n{part},", 1)[1].split("\n\n", 2)[1]
    return [re.match(r"\d+\. `([^`]+)`", line).group(1) for line in block.splitlines() if re.match(r"\d+\. ", line)]


def test_every_file_of_the_turn_exists():
    steps = _steps("In") + _steps("Out")
    assert len(_steps("In")) >= 8 and len(_steps("Out")) >= 4
    missing = [path for path in steps if not (ROOT / path).is_file()]
    assert not missing, f"docs/architecture.md names files that are gone: {missing}"


def test_the_spine_is_short_and_the_way_out_enters_no_file_twice():
    files = set(_steps("In")) | set(_steps("Out"))
    assert len(files) <= MAX_SPINE_FILES, sorted(files)
    out = _steps("Out")
    assert len(out) == len(set(out)), out
    stated = re.search(r"That is (\d+) files", _section())
    assert stated and int(stated.group(1)) == len(files), "the section's count is out of date"
