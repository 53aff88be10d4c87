"""The repository's shape: four wings that import only downward (app -> eval -> model -> kv)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minillama"
WINGS = ["kv", "model", "eval", "app"]  # each may import only from itself and the wings before it


def minillama_imports(path: Path) -> set[str]:
    """Every minillama module a file imports (module-level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minillama"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("minillama"))
    return found


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else None


@pytest.mark.parametrize("wing", WINGS)
def test_wings_import_only_downward(wing):
    allowed = set(WINGS[: WINGS.index(wing) + 1])
    for path in sorted((PACKAGE / wing).rglob("*.py")):
        upward = {m for m in minillama_imports(path) if wing_of(m) not in allowed | {None}}
        assert not upward, f"{path.relative_to(PACKAGE)} imports from a wing above it: {sorted(upward)}"


def test_every_module_lives_in_a_wing():
    loose = {p.name for p in PACKAGE.glob("*.py")}
    assert loose == {"__init__.py", "__main__.py", "errors.py"}, loose


def test_command_modules_do_not_import_the_cli():
    for path in (PACKAGE / "app" / "commands").glob("*.py"):
        assert "minillama.app.cli" not in minillama_imports(path), path.name
