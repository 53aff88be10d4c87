"""A kernel change measured against a git revision's kernels, both builds in one process, in turn.

    python tools/kernel_ab.py HEAD~1 8192 "fp16;hadv2;k3v2lm"                 # every native source
    python tools/kernel_ab.py b9c7a89 8192 "hadv2;kivi4" 12 smollm2 avx512_vnni_attention.cpp,rows.h

On a shared 2-core VM two separate runs differ by up to 30%, far more than most kernel changes
move; what holds is a ratio measured in one process with the two builds alternating. This builds
the tree's native sources (as ``native/build.py`` does) and a second library from the same
sources with the named files (default: every ``.cpp`` and ``.h``) taken from REV, builds each
spec's 30-layer cache once (``tools/attention_rounds.py: Layers``: synthetic fill, its shapes),
describes it to each library separately, and times one pass of ``attend_layer`` over all layers
with the tree's library, then with REV's, round after round. It prints each side's median per
layer and the median of the per-round ratios tree/REV (below 1: the tree is faster). Specs are
listed as tools/attention_rounds.py takes them (';', or '|' around ``layers=`` specs).
"""

from __future__ import annotations

import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from attention_rounds import Layers, spec_list  # tools/ is the script's folder, so on sys.path

from minillama.native import abi, backend, build


def library_at(rev: str, names: list[str], where: Path) -> ctypes.CDLL:
    """The native sources with `names` as they were at `rev`, compiled for this CPU into `where`."""
    native = build.HERE
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=native, capture_output=True, text=True)
    prefix = native.relative_to(root.stdout.strip()).as_posix()
    texts = {}
    for name in names:
        old = subprocess.run(["git", "show", f"{rev}:{prefix}/{name}"], cwd=native, capture_output=True, text=True)
        if old.returncode:
            sys.exit(f"{name} at {rev}: {old.stderr.strip()}")
        texts[name] = old.stdout
    return library_with(texts, where, f"{rev}'s kernels")


def library_with(texts: dict[str, str], where: Path, what: str) -> ctypes.CDLL:
    """The tree's native sources with the files named in `texts` replaced by those texts, compiled
    for this CPU into `where` (a fresh folder); `what` names the build in an error."""
    shutil.copytree(build.HERE, where / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for name, text in texts.items():
        (where / "src" / name).write_text(text)
    out = where / "lib.so"
    sources = [str(where / "src" / s.name) for s in build.SOURCES]
    done = subprocess.run(
        [build.compiler(), *build.compile_flags("native"), *sources, "-o", str(out)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"building {what} failed: {done.stderr[-2000:]}")
    lib = ctypes.CDLL(str(out))
    abi.bind(lib)
    return lib


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rev = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    specs = spec_list(sys.argv[3] if len(sys.argv) > 3 else "fp16;hadv2")
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 12
    shape = sys.argv[5] if len(sys.argv) > 5 else "smollm2"
    names = sys.argv[6].split(",") if len(sys.argv) > 6 else sorted(p.name for p in build.HERE.glob("*.[ch]*"))
    new = backend.library()
    if new is None:
        sys.exit(f"the kernels are not in use: {backend.describe()}")
    layers = Layers(shape, n)
    with tempfile.TemporaryDirectory() as tmp:
        old = library_at(rev, [x for x in names if x.endswith((".cpp", ".h"))], Path(tmp))
        print(f"{backend.describe()}; tree vs {rev} ({', '.join(names)}); {shape} layer; {n} tokens; {rounds} rounds")
        for kv in specs:
            cache = layers.cache(kv)
            plans = {lib: layers.plans(lib, cache) for lib in (new, old)}
            times: dict[ctypes.CDLL, list[float]] = {new: [], old: []}
            for _ in range(rounds):
                for lib in (new, old):
                    times[lib].append(Layers.seconds(lib, plans[lib]) * 1e6)
            ratio = statistics.median(a / b for a, b in zip(times[new], times[old]))
            print(
                f"{kv:10s} tree {statistics.median(times[new]):7.0f} us  {rev} {statistics.median(times[old]):7.0f} us"
                f"  tree/{rev} {ratio:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
