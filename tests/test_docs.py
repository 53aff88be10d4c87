"""The docs name code that exists: every `file: function()` of the reading guide, every file the
README and the user docs point at, and their length limits."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "reading-guide.md"
USER_DOCS = [
    "cache.md",
    "chat.md",
    "long-context.md",
    "prompt-cache.md",
    "quality.md",
    "speed.md",
    "reading-guide.md",
    "transformers.md",
]


def defined(path: Path) -> set[str]:
    """Names a file defines: top-level functions, classes and assignments, and ``Class.member``."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef):
                    names.add(f"{node.name}.{member.name}")
        if isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def named_in_guide() -> list[tuple[str, str]]:
    """(file, name) for every `minillama/...py: name()` or `...: Name` the guide names."""
    return re.findall(r"`(minillama/[\w/]+\.py): ([\w.]+)(?:\(\))?`", GUIDE.read_text())


def test_the_guide_names_things_to_check():
    assert len(named_in_guide()) >= 25


@pytest.mark.parametrize("where,name", named_in_guide())
def test_every_function_the_reading_guide_names_is_in_that_file(where, name):
    path = REPO / where
    assert path.is_file(), where
    assert name in defined(path), f"{where} has no {name}"


@pytest.mark.parametrize("doc", ["README.md", *(f"docs/{d}" for d in USER_DOCS)])
def test_every_repository_path_a_doc_names_exists(doc):
    text = (REPO / doc).read_text()
    paths = set(
        re.findall(r"(?<![\w/.])((?:minillama|bench|tools|docs|tests)/[\w/.-]+\.(?:py|md|json|txt|png|kv|cpp|h))", text)
    )
    missing = [p for p in sorted(paths) if not (REPO / p).exists()]
    assert not missing, missing


def test_the_readme_and_the_user_docs_stay_short():
    readme = len((REPO / "README.md").read_text().splitlines())
    lines = {d: len((REPO / "docs" / d).read_text().splitlines()) for d in USER_DOCS}
    assert readme <= 150, readme
    assert lines["quality.md"] <= 300 and lines["speed.md"] <= 200 and lines["reading-guide.md"] <= 150, lines
    assert sum(lines.values()) <= 1200, lines


def test_the_guide_names_only_the_reference_path_until_its_last_section():
    """The path of one token never leaves the core: the compiled wing appears only in the last
    section, which says where it is."""
    body = GUIDE.read_text().split("## The compiled path")[0]
    assert "minillama/native" not in body.split("## 0.")[1]
