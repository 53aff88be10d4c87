"""Where one kernel's time goes, line by line of its source: `perf` samples over a bench command.

    OMP_NUM_THREADS=1 python bench/kernel_lines.py value_bytes python bench/route_ab.py values 8192 hadv2 1500
    OMP_NUM_THREADS=1 python bench/kernel_lines.py score_int4 python bench/route_ab.py scores 8192 hadv2 1500

The command runs under ``perf record -e cpu-clock`` with the kernels built with line tables
(``MINILLAMA_LINE_TABLES=1``: ``-g``, the same code, its own library in the cache, built
before the recording so the compiler is not sampled). Of the symbols whose name contains the
first argument, the one with the most samples is annotated; each sampled instruction is charged
to the innermost line of the kernel's own source file that it came from (an inlined helper of
another file, an intrinsic of a compiler header, counts on the line that called it), and the
lines are printed with their share of that symbol's samples, the largest first, each with its
source text. Needs Linux ``perf`` (and ``perf_event_paranoid`` that lets a user sample its own
processes) and binutils' ``addr2line``. How docs/speed.md takes a kernel apart.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NATIVE = Path(__file__).resolve().parent.parent / "minillama" / "native"
SAMPLE = re.compile(r"^\s*(\d+\.\d+)\s*:\s*([0-9a-f]+):")  # perf annotate --stdio: "  1.23 :   ad7f0:  vpaddw ..."


def charge(frames: list[str], own: str | None) -> str | None:
    """addr2line -i's frames of one address (innermost first, "file:line" each) -> the innermost
    frame in the kernel's own file (the outermost frame's file), as "file:line"."""
    files = [f.rsplit(":", 1)[0] for f in frames]
    own = own or (files[-1] if files else None)
    for frame, file in zip(frames, files):
        if file == own:
            return frame.split(" ")[0]
    return None


def by_source_line(lib: str | Path, weights: dict[int, float]) -> collections.Counter:
    """Weights of instruction addresses in `lib` (offsets in the file) summed by source line:
    each address charged to the innermost line of the kernel's own file (`charge`), found by
    addr2line -i in the library's line tables (bench/kernel_instructions.py uses it too)."""
    out = subprocess.run(
        ["addr2line", "-i", "-a", "-e", str(lib), *(hex(a) for a in weights)], capture_output=True, text=True
    ).stdout
    frames: dict[int, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("0x"):
            frames[current := int(line, 16)] = []
        else:
            frames[current].append(line.strip())
    own = next((fr[-1].rsplit(":", 1)[0] for fr in frames.values() if fr and "??" not in fr[-1]), None)
    lines: collections.Counter = collections.Counter()
    for address, weight in weights.items():
        lines[charge(frames.get(address, []), own) or "(no line)"] += weight
    return lines


def libraries(data: Path) -> list[Path]:
    """The files of the shared libraries a recording sampled (perf's build-id list)."""
    listed = subprocess.run(["perf", "buildid-list", "-i", str(data)], capture_output=True, text=True).stdout
    return [Path(line.split(" ", 1)[1]) for line in listed.splitlines() if " " in line]


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    want, command = sys.argv[1], sys.argv[2:]
    for tool in ("perf", "addr2line"):
        if not shutil.which(tool):
            sys.exit(f"kernel_lines: `{tool}` is not installed (Linux perf tools and binutils are needed)")
    env = dict(os.environ, MINILLAMA_LINE_TABLES="1")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        built = subprocess.run(
            [sys.executable, "-c", "from minillama.native import backend; print(backend.describe())"],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        print(built.stdout.strip())
        rec = subprocess.run(["perf", "record", "-e", "cpu-clock", "-o", str(data), "--", *command], env=env)
        if rec.returncode:
            sys.exit(f"kernel_lines: `perf record` failed (exit {rec.returncode}); is perf_event_paranoid too strict?")
        report = subprocess.run(
            ["perf", "report", "-i", str(data), "--stdio", "--sort", "dso,sym"], capture_output=True, text=True
        ).stdout
        rows = [line for line in report.splitlines() if want in line and not line.startswith("#")]
        if not rows:
            sys.exit(f"kernel_lines: no samples in a symbol containing {want!r}")
        share, dso, symbol = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[\.\]\s+(.*)$", rows[0]).groups()
        print(f"{symbol}: {share}% of all samples")
        lib = next((path for path in libraries(data) if path.name == dso), None)
        if lib is None:
            sys.exit(f"kernel_lines: perf did not record where {dso} was loaded from")
        annotated = subprocess.run(
            ["perf", "annotate", "-i", str(data), "--stdio", "-s", symbol], capture_output=True, text=True
        ).stdout
    samples = {int(m[2], 16): float(m[1]) for m in map(SAMPLE.match, annotated.splitlines()) if m and float(m[1]) > 0}
    lines = by_source_line(lib, samples)
    for where, pct in lines.most_common(25):
        file, _, number = where.rpartition(":")
        source = source_lines(Path(file).name)
        text = source[int(number) - 1].strip()[:90] if number.isdigit() and 0 < int(number) <= len(source) else ""
        print(f"{pct:6.2f}%  {Path(where).name:32s} {text}")


@functools.cache
def source_lines(name: str) -> list[str]:
    """The lines of native/`name`, read once however many of its lines are printed ([] if absent)."""
    source = NATIVE / name
    return source.read_text().splitlines() if source.exists() else []


if __name__ == "__main__":
    main()
