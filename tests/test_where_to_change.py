"""docs/where-to-change-what.md names files and the functions, classes and tables in them: each one
must exist, so a rename fails here instead of leaving the page wrong (issue 50, item 7). Reads
files only (quick tier)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "where-to-change-what.md"
CODE = re.compile(r"`([^`]+)`")
PATH = re.compile(r"^[\w./-]+\.(?:py|md|yml)$")


def _rows() -> list[tuple[str, list[str]]]:
    """Each table row's file and the names its second cell gives (`A.b`: b defined in class A)."""
    rows = []
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) == 3:
            (path,) = CODE.findall(cells[0])
            rows.append((path, CODE.findall(cells[1])))
    return rows


def _defines(source: str, name: str) -> bool:
    """A def or class of that name, or an assignment to it (a module's or a class's)."""
    owner, _, name = name.rpartition(".")
    if owner:
        found = re.search(rf"^class {re.escape(owner)}\b", source, re.M)
        return found is not None and _defines(source[found.start():], name)
    return re.search(rf"^\s*(?:(?:async\s+)?def|class)\s+{re.escape(name)}\b|^\s*{re.escape(name)}\s*[:=,]",
                     source, re.M) is not None


def test_the_page_has_its_tables_and_is_in_the_site():
    rows = _rows()
    assert len(rows) >= 50, len(rows)  # (a table the parser stopped reading would show here)
    assert "where-to-change-what.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "where-to-change-what.md" in (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("path, names", _rows(), ids=lambda v: v if isinstance(v, str) else ",".join(v))
def test_each_file_and_name_on_the_page_exists(path, names):
    source = (ROOT / path).read_text(encoding="utf-8")
    missing = [name for name in names if not _defines(source, name)]
    assert not missing, f"{PAGE.name}: {path} defines no {missing}"


def test_every_file_the_page_names_exists():
    named = {code for code in CODE.findall(PAGE.read_text(encoding="utf-8")) if PATH.match(code)}
    assert named, "no file named"
    assert not [p for p in sorted(named) if not (ROOT / p).is_file()]
