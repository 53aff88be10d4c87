"""How many instructions of each kind one core issues per cycle, alone and two kinds together.

    python bench/instruction_rates.py

The VMs this project runs on have no cycle or instruction counters, so a kernel's instruction
count (``bench/kernel_instructions.py``) becomes time only through what the core can issue per
cycle of each kind. This measures it: for each kind below, a loop of 32 independent instructions
(read-modify-write ones take 8 accumulators in turn, so no chain is the limit), best of 3 over
~100 M instructions; the clock from a chain of dependent scalar adds (one a cycle). Each kind is
then interleaved with three references -- the dot product ``vpdpbusd``, the cross-lane permute
``vpermd``, the shift ``vpsrld``, each 2 a cycle on the Zen 5 VMs -- and the pair's rate says
whether they share pipes: two kinds of 2 a cycle that use different pipes run 4 a cycle together,
the same pipes 2, one pipe in common ~3. Loads read a static buffer through a general register;
``load zmm rsp`` reads the stack through ``%rsp`` instead, which the Zen 5 VMs issue at half the
rate (1 a cycle against 2: the stack's own addressing, what a compiler's spills and locals
use). ``--mix`` of ``bench/kernel_instructions.py`` takes its model of the pipes (``PIPE_CLASSES``)
from what this printed (docs/speed.md). x86-64 with AVX-512 BW and VNNI, and gcc, only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

# kind -> its instruction for the j-th copy (accumulators zmm4-11 for read-modify-write kinds)
KINDS = {
    "vpdpbusd": lambda j: f"vpdpbusd %zmm1, %zmm1, %zmm{4 + j % 8}",
    "vpermd": lambda j: "vpermd %zmm1, %zmm1, %zmm2",
    "vpsrld": lambda j: "vpsrld $4, %zmm1, %zmm3",
    "vpdpwssd": lambda j: f"vpdpwssd %zmm1, %zmm1, %zmm{4 + j % 8}",
    "vfmadd231ps": lambda j: f"vfmadd231ps %zmm1, %zmm1, %zmm{4 + j % 8}",
    "vmulps": lambda j: "vmulps %zmm1, %zmm1, %zmm12",
    "vpshufb": lambda j: "vpshufb %zmm1, %zmm1, %zmm13",
    "vpermt2d": lambda j: f"vmovdqa64 %zmm1, %zmm{4 + j % 8}\n\tvpermt2d %zmm1, %zmm2, %zmm{4 + j % 8}",
    "vpmovdb": lambda j: "vpmovdb %zmm1, %xmm14",
    "vpbroadcastd reg": lambda j: "vpbroadcastd %xmm1, %zmm15",
    "vcvtdq2ps": lambda j: "vcvtdq2ps %zmm1, %zmm16",
    "vcvtph2ps": lambda j: "vcvtph2ps %ymm1, %zmm17",
    "vmaxps": lambda j: "vmaxps %zmm1, %zmm1, %zmm18",
    "vpaddd": lambda j: "vpaddd %zmm1, %zmm1, %zmm19",
    "vpandd": lambda j: "vpandd %zmm1, %zmm3, %zmm20",
    "vpermilps imm": lambda j: "vpermilps $0xb1, %zmm1, %zmm21",
    "vpunpcklbw": lambda j: "vpunpcklbw %zmm1, %zmm1, %zmm22",
    "load zmm": lambda j: f"vmovdqu64 {64 * (j % 4)}(BUF), %zmm23",
    "load zmm rsp": lambda j: (
        f"vmovdqu64 {64 * (j % 4) - 512}(%rsp), %zmm23"
    ),  # below the stack pointer: see the docstring
    "load ymm": lambda j: f"vmovdqu64 {32 * (j % 8)}(BUF), %ymm24",
    "vpbroadcastd mem": lambda j: "vpbroadcastd (BUF), %zmm25",
    "store zmm": lambda j: f"vmovdqu64 %zmm1, {64 * (j % 4)}(BUF)",
    "lea": lambda j: "lea (%rsi, %rsi), %rax",
}
REFERENCES = ("vpdpbusd", "vpermd", "vpsrld")
COPIES = 32
CLOBBERS = ", ".join(f'"xmm{i}"' for i in range(2, 26)) + ', "rax", "memory"'


def loop(name: str, kinds: tuple[str, ...]) -> str:
    """A C function running `kinds` interleaved, COPIES of each, n times (memory: a static buffer)."""
    body = []
    for j in range(COPIES):
        body += [KINDS[k](j) for k in kinds]
    text = "\\n\\t".join(body).replace("\n\t", "\\n\\t").replace("%", "%%").replace("BUF", "%0")
    return (
        f"static void {name}(long n) {{ for (long i = 0; i < n; i++) "
        f'asm volatile("{text}" :: "r"(buffer) : {CLOBBERS}); }}'
    )


def source(runs: list[tuple[str, ...]]) -> str:
    lines = [
        "#include <stdio.h>",
        "#include <time.h>",
        "static char buffer[4096] __attribute__((aligned(64)));",
        "static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }",
        "static void chain(long n) { long x = 1; for (long i = 0; i < n; i++) "
        'asm volatile("add %0, %0\\n\\tadd %0, %0\\n\\tadd %0, %0\\n\\tadd %0, %0" : "+r"(x)); }',
    ]
    lines += [loop(f"f{i}", kinds) for i, kinds in enumerate(runs)]
    lines.append(
        "static double best(void (*f)(long), long n) { f(1000); double b = 1e9; for (int r = 0; r < 3; r++) "
        "{ double t0 = now(); f(n); double t = now() - t0; if (t < b) b = t; } return b; }"
    )
    lines.append("int main() {")
    lines.append('    printf("%.4f\\n", 4e8 / best(chain, 100000000) / 1e9);')
    for i, kinds in enumerate(runs):
        per = COPIES * len(kinds)
        n = 100_000_000 // per
        lines.append(f'    printf("%.4f\\n", {n}.0 * {per} / best(f{i}, {n}) / 1e9);')
    lines.append("}")
    return "\n".join(lines)


def main() -> None:
    if os.uname().machine != "x86_64":
        sys.exit("instruction_rates.py runs x86-64 instructions: not this machine")
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    missing = sorted({"avx512f", "avx512bw", "avx512_vnni"} - flags)
    if missing:
        sys.exit(f"the probe runs AVX-512 BW and VNNI instructions; this CPU lacks {', '.join(missing)}")
    runs = [(k,) for k in KINDS] + [(k, r) for k in KINDS for r in REFERENCES if k not in REFERENCES]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "rates.c", Path(tmp) / "rates"
        src.write_text(source(runs))
        built = subprocess.run(["gcc", "-O2", "-mavx512f", str(src), "-o", str(exe)], capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"building the probe failed: {built.stderr[-1500:]}")
        values = [
            float(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
        ]
    ghz, rates = values[0], dict(zip(runs, values[1:]))
    print(f"clock {ghz:.2f} GHz (dependent adds); instructions per cycle, alone and interleaved with each reference")
    print(f"{'kind':18s} {'alone':>6s}  " + "  ".join(f"{'+ ' + r:>11s}" for r in REFERENCES))
    for k in KINDS:
        alone = rates[(k,)] / ghz  # vpermt2d's move beside it is not counted (a move is renamed, not run)
        cells = [f"{rates[(k, r)] / ghz:11.2f}" if (k, r) in rates else f"{'-':>11s}" for r in REFERENCES]
        print(f"{k:18s} {alone:6.2f}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
