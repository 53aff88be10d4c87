"""The repository's shape: a core that reads on its own, and wings that import only downward.

The core is ``kv`` (the cache) and ``model`` (the Llama over it). The compiled wing, ``native``,
sits beside it: it reads the core's objects, the core never imports it. ``eval`` sits on top,
``hf`` (minillama's cache inside transformers, its ruler over eval's) above it, ``app`` above
everything. Only ``hf`` imports transformers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minillama"
# each may import only from itself and the wings before it; hf (transformers) sits over eval's ruler
WINGS = ["kv", "model", "weights", "native", "eval", "hf", "app"]


def minillama_imports(path: Path) -> set[str]:
    """Every minillama module a file imports: module-level, inside functions, under TYPE_CHECKING."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minillama"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("minillama"))
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else None


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a name imported from a module counts as that
    module, or as the submodule of that name); a package's ``__init__`` is not followed."""
    graph = {}
    for name, path in MODULES.items():
        targets = set()
        for m in minillama_imports(path):
            while m and m not in MODULES:
                m = m.rpartition(".")[0]
            if m and m != name and not MODULES[m].name == "__init__.py":
                targets.add(m)
        graph[name] = targets
    return graph


def test_no_module_imports_itself_back_through_a_circle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, "import circle: " + " -> ".join([*path[path.index(n) :], n])
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_no_module_reaches_into_another_modules_private_names():
    """``x._name`` only where ``_name`` is this file's own (its functions, classes and attributes):
    another module's private names, and a module's private functions, stay private (torch's own
    are torch's business)."""
    reached = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        own = set()  # what this file defines: functions, classes, and every name or attribute it assigns
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                own.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if node.attr not in own and not (isinstance(root, ast.Name) and root.id == "torch"):
                    reached.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.attr}")
    assert not reached, reached


def test_importing_generation_loads_the_core_alone():
    """``import minillama.model.generate`` -- the model, the cache protocol, sampling, generation --
    loads at most 20 package modules and 3,000 lines, none from the compiled wing, eval or app."""
    code = "import sys, minillama.model.generate; print(*sorted(m for m in sys.modules if m.startswith('minillama')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    lines = sum(len(MODULES[m].read_text().splitlines()) for m in loaded)
    assert not [m for m in loaded if wing_of(m) in ("native", "eval", "app")], loaded
    assert len(loaded) <= 20 and lines <= 3000, (len(loaded), lines)


@pytest.mark.parametrize("wing", WINGS)
def test_wings_import_only_downward(wing):
    allowed = set(WINGS[: WINGS.index(wing) + 1])
    for path in sorted((PACKAGE / wing).rglob("*.py")):
        upward = {m for m in minillama_imports(path) if wing_of(m) not in allowed | {None}}
        assert not upward, f"{path.relative_to(PACKAGE)} imports from a wing above it: {sorted(upward)}"


def test_only_the_hf_wing_imports_transformers():
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if "import transformers" in text or "from transformers" in text:
            assert path.parent.name == "hf", f"{path.relative_to(PACKAGE)} imports transformers outside minillama/hf"


def test_every_module_lives_in_a_wing():
    loose = {p.name for p in PACKAGE.glob("*.py")}
    assert loose == {"__init__.py", "__main__.py", "errors.py"}, loose


def test_the_backend_is_decided_in_one_module():
    """One switch: only native/backend.py reads the environment's backend choice, and no other
    module keeps a flag of its own for whether the fast paths run."""
    import re

    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(PACKAGE).as_posix()
        if where != "native/backend.py":
            assert not re.search(r"environ.*MINILLAMA_(BACKEND|KERNEL|EXACT)", text), where
        assert not re.search(r"self\.(fused|fast_ops|kernel|fast)\s*=", text), where


def test_each_instruction_set_twin_says_its_target_in_its_file_name():
    """A kernel file named for a target is compiled for that target alone (its code sits behind
    that target's guard), and a portable one uses no intrinsics; the other sources choose among
    targets inside (``#if`` branches with a plain loop beside every vector one)."""
    guards = {"avx2_": "__AVX2__", "avx512_vnni_": "__AVX512VNNI__", "avx512_": "__AVX512F__"}
    for path in sorted((PACKAGE / "native").glob("*.cpp")):
        text = path.read_text()
        if path.name.startswith("portable_"):
            assert "immintrin.h" not in text and "arm_neon.h" not in text, path.name
        for prefix, guard in guards.items():
            if path.name.startswith(prefix):  # the file's first condition is its target's
                assert guard in next(line for line in text.splitlines() if line.startswith("#if")), path.name
                break


def test_command_modules_do_not_import_the_cli():
    for path in (PACKAGE / "app" / "commands").glob("*.py"):
        assert "minillama.app.cli" not in minillama_imports(path), path.name


# -- the clone stands alone ------------------------------------------------------------

REPO = PACKAGE.parent
OUTSIDE = "../" + "shared"  # spelled in two pieces so this file does not trip its own check


def tracked_files() -> list[Path]:
    """Files under minillama/, tests/, bench/, docs/ and the README, as git tracks them."""
    import subprocess

    where = ["minillama", "tests", "bench", "docs", "README.md"]
    done = subprocess.run(["git", "ls-files", "-z", *where], cwd=REPO, capture_output=True, text=True)
    if done.returncode == 0 and done.stdout:
        return [REPO / name for name in done.stdout.split("\0") if name]
    return [p for w in where for p in ([REPO / w] if (REPO / w).is_file() else (REPO / w).rglob("*")) if p.is_file()]


def climbs_above_root(path: Path, source: str) -> list[str]:
    """Path(__file__) climbs (.parent chains, parents[i]) that leave the repository."""
    import re

    depth = len(path.relative_to(REPO).parts) - 1  # parents[depth] of the file is the repository root
    bad = []
    for m in re.finditer(r"__file__\)(?:\.resolve\(\))?((?:\.parent)+)", source):
        if m.group(1).count(".parent") - 1 > depth:
            bad.append(m.group(0))
    for m in re.finditer(r"__file__\)(?:\.resolve\(\))?\.parents\[(\d+)\]", source):
        if int(m.group(1)) > depth:
            bad.append(m.group(0))
    bad += re.findall(r"""["']\.\./[^"']*["']""", source)  # a relative path that starts above the working directory
    return bad


def test_nothing_tracked_reaches_outside_the_clone():
    offenders = []
    for path in tracked_files():
        if path.suffix in (".png", ".so", ".gguf") or not path.exists():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if OUTSIDE in text:
            offenders.append(f"{path.relative_to(REPO)} mentions {OUTSIDE}")
        if path.suffix == ".py" and path != Path(__file__).resolve():  # this file's examples are data
            offenders += [f"{path.relative_to(REPO)}: {c}" for c in climbs_above_root(path, text)]
    assert not offenders, "files that need something outside the repository:\n" + "\n".join(offenders)


def test_the_guard_sees_a_climb_out_of_the_repository():
    fake = REPO / "minillama" / "model" / "x.py"
    assert climbs_above_root(fake, "Path(__file__).resolve().parents[3] / 'data'")
    assert climbs_above_root(fake, "Path(__file__).parent.parent.parent.parent")
    assert not climbs_above_root(fake, "Path(__file__).parent.parent.parent")
    assert climbs_above_root(fake, "open('../data/x.txt')")
    assert not climbs_above_root(fake, "Path(__file__).resolve().parents[2] / 'weights'")
