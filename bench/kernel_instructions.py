"""How many instructions one layer's decode attention executes per KV token: counted, by kernel.

    python bench/kernel_instructions.py 1024,2048 "fp16;kivi4;hadv2;k4v3hc;k4v3lmc;k3v2lm"
    python bench/kernel_instructions.py 1024,2048 "hadv2;k4v3lmc" tinyllama
    python bench/kernel_instructions.py 2048 hadv2 --lines score_vnni     # that kernel by source line
    python bench/kernel_instructions.py 1024,2048 "hadv2;k4v3hc" --mix   # each group's instructions by kind

For each spec and context a child process fills one layer's cache (bench/attention_rounds.py:
``Layers``, synthetic K/V), calls ``attend_layer`` once to warm up, and calls it again under
``ptrace`` single-stepping on one thread (``OMP_NUM_THREADS=1``): every instruction that call
executes is counted and charged to the symbol it belongs to -- the score kernels (symbols named
``score_*``), the value kernels (``value_*``), the rest of the kernel library (the driver:
online softmax, merge, sinks and residual parts, queries' preparation) and other libraries
(OpenMP, libc) by name. Nothing is sampled or estimated: the counts are exact for this build on
this CPU (the kernels choose their instruction set at run time, so another CPU runs other code).

Each row is per held token and KV head, the unit one layer's time is made of. With two or
more contexts the per-token numbers are the slope between the first and the last (what one
more token costs) and ``fixed`` is the call's count at zero tokens by the same line; with one
they are the call's total over its tokens. ``madd`` counts the integer multiply-adds
(``vpdpbusd``, ``vpdpwssd``, ``vpmaddubsw``, ``vpmaddwd``) and float FMAs among them. Set
beside a kernel's time per KV token (``bench/attention_micro.py``) a count gives instructions
per nanosecond (docs/speed.md). ``--lines KERNEL`` builds the kernels with line tables (the
same code, ``MINILLAMA_LINE_TABLES=1``) and charges that kernel's count at the last context to
its source lines, as bench/kernel_lines.py charges perf's samples. ``--mix`` lists each group's
instructions per KV token by kind (mnemonic, register width, memory source or destination: what
the core's rates depend on, ``bench/instruction_rates.py``), everything from 0.05 up, then the
same by pipe class (``PIPE_CLASSES``: a model of the Zen 5 VMs' vector pipes and load and store
ports, from what instruction_rates.py measured there) with the fewest cycles a KV token those
pipes and ports need -- set beside the kernel's measured cycles, the share its instructions'
issue explains.

Linux x86-64 only: needs ``ptrace`` of one's own child (``kernel.yama.ptrace_scope`` 0 or 1)
and binutils' ``nm``, ``objdump`` (and ``addr2line`` for ``--lines``). A 2048-token hadv2 layer is
~0.6 M single steps, about half a minute on this project's VMs.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from kernel_lines import by_source_line, source_lines  # bench/ is the script's folder, so on sys.path

PTRACE_TRACEME, PTRACE_CONT, PTRACE_KILL, PTRACE_SINGLESTEP, PTRACE_GETREGS = 0, 7, 8, 9, 12
MADD = re.compile(r"^(vpdpbusds?|vpdpwssds?|vpmaddubsw|vpmaddwd|vfn?madd\w+)$")


class Regs(ctypes.Structure):  # struct user_regs_struct (x86-64)
    _fields_ = [
        (name, ctypes.c_ulong)
        for name in (
            "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags rsp ss "
            "fs_base gs_base ds es fs gs"
        ).split()
    ]


def child(n: int, kv: str, shape: str, info: str) -> None:
    """The traced process: one layer of `kv` at `n` tokens, warmed up, then the counted call."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from attention_rounds import Layers

    from minillama.native import backend, ops

    lib = backend.library()
    if lib is None:
        sys.exit(f"the kernels are not in use: {backend.describe()}")
    layers = Layers(shape, n)
    layers.layers = 1  # one layer is all that is counted
    plan = layers.plans(lib, layers.cache(kv))[0]
    ops.attend_layer(lib, plan)  # warm: lazy tables, the OpenMP team
    entry = ctypes.cast(lib.attend_layer, ctypes.c_void_p).value
    Path(info).write_text(
        json.dumps({"lib": lib._name, "entry": entry, "heads": layers.h, "describe": backend.describe()})
    )
    signal.raise_signal(signal.SIGTRAP)  # the tracer steps from here
    lib.attend_layer(ctypes.byref(plan))


def trace(n: int, kv: str, shape: str) -> tuple[collections.Counter, dict, str]:
    """Run `child` for (n, kv, shape) and count every instruction its second attend_layer runs:
    a Counter of instruction addresses, the child's info and its memory maps."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    with tempfile.TemporaryDirectory() as tmp:
        info_path = os.path.join(tmp, "info.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(n), kv, shape, info_path],
            env=env,
            preexec_fn=lambda: libc.ptrace(PTRACE_TRACEME, 0, None, None),
        )
        pid, regs = proc.pid, Regs()

        def wait() -> int:
            _, status = os.waitpid(pid, 0)
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                sys.exit(f"{kv} at {n}: the child ended before its counted call (run it alone to see why)")
            return os.WSTOPSIG(status)

        wait()  # the stop at exec
        libc.ptrace(PTRACE_CONT, pid, None, None)
        while (sig := wait()) != signal.SIGTRAP:  # forward anything else until the marker
            libc.ptrace(PTRACE_CONT, pid, None, sig)
        info = json.loads(Path(info_path).read_text())
        entry, sp0, counts = info["entry"], None, collections.Counter()
        while True:
            if libc.ptrace(PTRACE_SINGLESTEP, pid, None, None) != 0:
                sys.exit(f"ptrace failed (errno {ctypes.get_errno()}): is ptrace of a child allowed here?")
            wait()
            libc.ptrace(PTRACE_GETREGS, pid, None, ctypes.byref(regs))
            if sp0 is None:
                if regs.rip == entry:
                    sp0 = regs.rsp
                    counts[regs.rip] += 1
                continue
            if regs.rsp > sp0:  # attend_layer returned
                break
            counts[regs.rip] += 1
        maps = Path(f"/proc/{pid}/maps").read_text()
        libc.ptrace(PTRACE_KILL, pid, None, None)
        proc.wait()
    return counts, info, maps


def mappings(maps: str) -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of every file-backed mapping."""
    out = []
    for line in maps.splitlines():
        parts = line.split()
        if len(parts) >= 6:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, int(parts[2], 16), parts[5]))
    return out


@functools.cache  # every spec and context runs the same build: nm once per library file
def symbols(lib: str) -> list[tuple[int, int, str]]:
    """(offset, size, demangled name) of the library's sized text symbols, sorted."""
    text = subprocess.run(["nm", "-C", "-S", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"([0-9a-f]+) ([0-9a-f]+) [tTwW] (.*)", line)
        if m:
            out.append((int(m.group(1), 16), int(m.group(2), 16), m.group(3)))
    return sorted(out)


def symbol_at(syms: list[tuple[int, int, str]], offset: int) -> str | None:
    """The name of the symbol of `syms` (sorted, as `symbols` gives them) that holds `offset`."""
    i = bisect.bisect_right(syms, (offset, float("inf"), "")) - 1
    return syms[i][2] if i >= 0 and offset < syms[i][0] + max(syms[i][1], 1) else None


@functools.cache  # objdump once per library file, for charge and --mix alike
def disassembly(lib: str) -> dict[int, tuple[str, str]]:
    """Offset -> (mnemonic, operands) of every instruction in the library's code."""
    text = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", lib], capture_output=True, text=True, check=True
    ).stdout
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*([0-9a-f]+):\s+(\S+)\s*([^#<]*)", line)
        if m:
            out[int(m.group(1), 16)] = (m.group(2), m.group(3).strip())
    return out


def mnemonics(lib: str) -> dict[int, str]:
    """Offset -> mnemonic of every instruction in the library's code."""
    return {off: op for off, (op, _) in disassembly(lib).items()}


def kind_of(op: str, operands: str) -> str:
    """An instruction's kind as --mix counts it: the mnemonic, with its widest register (zmm,
    ymm, xmm; vector instructions), whether it reads memory ('load': a memory source, '1toN': a
    broadcast one) or writes it ('store'), and 'stack' when that memory is addressed through
    %rsp -- the distinctions bench/instruction_rates.py shows the core's rates depend on."""
    if not op.startswith("v"):
        return "scalar " + ("branch" if op.startswith("j") or op in ("call", "ret") else "other")
    width = next((w for w in ("zmm", "ymm", "xmm") if "%" + w in operands), "")
    last = re.split(r",(?![^(]*\))", operands)[-1]  # AT&T: the destination last (commas inside (...) kept)
    memory = "(" in operands
    if "(" in last:
        where = " store"
    elif memory:
        where = " 1toN" if "1to" in operands else " load"
    else:
        where = ""
    if memory and "(%rsp" in operands:  # the stack's own addressing: loads issue at half the rate
        where += " stack"
    return f"{op} {width}{where}".strip()


def group_of(name: str) -> str:
    """The kernel library's symbols in three groups (an inlined helper counts with its caller)."""
    bare = name.replace("(anonymous namespace)::", "").split("(")[0]
    if "score_" in bare:
        return "scores"
    if "value_" in bare:
        return "values"
    return "driver"


def library_base(info: dict, maps: str) -> int:
    """Where the kernel library was loaded in the child (its offsets are addresses less this)."""
    real = os.path.realpath(info["lib"])
    return min(start - offset for start, _, offset, path in mappings(maps) if os.path.realpath(path) == real)


def by_line(counts: collections.Counter, info: dict, maps: str, want: str) -> collections.Counter:
    """The counts of the symbols whose name contains `want`, charged to source lines (the
    innermost line of the symbol's own file, as bench/kernel_lines.py charges perf's samples)."""
    base, syms = library_base(info, maps), symbols(info["lib"])
    picked = {}
    for pc, c in counts.items():
        name = symbol_at(syms, pc - base)
        if name is not None and want in name:
            picked[pc - base] = c
    return by_source_line(info["lib"], picked)


# The pipes of the Zen 5 VMs' vector side as bench/instruction_rates.py measured them (machine Y,
# docs/speed.md): four pipes; the multiply kinds, the shuffles and the shifts/conversions/float
# adds each run 2 a cycle and pairwise share one pipe, integer adds, logic and in-lane immediate
# shuffles run on all four; loads issue 2 a cycle (of any width, broadcasts too), but 1 a cycle
# when addressed through %rsp (the stack: locals and spills); a 64-byte store 1 a cycle. A model
# of this CPU, not of others.
PIPE_CLASSES = (
    ("mul", re.compile(r"^v(pdp|pmadd|fn?m(add|sub)|mul|pmul)")),
    (
        "shuffle",
        re.compile(r"^v(perm(?!il)|pshufb|pmov(?!msk)|p?broadcast|shuf[fi]|insert|extract|p?align|pcompress|pexpand)"),
    ),
    ("shift/convert", re.compile(r"^v(ps[rl]|cvt|rndscale|round|add[ps][sd]|sub[ps][sd]|max|min|rcp|rsqrt|cmp[ps])")),
)


CLASSES = ("mul", "shuffle", "shift/convert", "any", "move", "load", "load stack", "broadcast", "store", "scalar")
BROADCASTS = ("vpbroadcastd", "vpbroadcastq", "vbroadcastss", "vbroadcastsd")


def pipe_class(kind: str) -> str:
    """The --mix kind's share of the core (PIPE_CLASSES): 'load', 'load stack', 'broadcast' or
    'store' for an instruction that only moves data to or from memory, 'move' for a register
    copy, 'scalar', else its vector class ('any' when no pattern matches). An operation that
    also reads or writes memory counts here as its class; `pipe_cycles` adds its port's share."""
    if kind.startswith("scalar"):
        return "scalar"
    op, *rest = kind.split()
    if op.startswith("vmov") or (op in BROADCASTS and "load" in rest):
        if "store" in rest:
            return "store"
        if op in BROADCASTS:
            return "broadcast"
        if "load" in rest:
            return "load stack" if "stack" in rest else "load"
        return "move"
    return next((name for name, pattern in PIPE_CLASSES if pattern.match(op)), "any")


def pipe_cycles(kinds: collections.Counter) -> tuple[float, dict[str, float]]:
    """Per KV token: the fewest cycles the vector pipes and the load and store ports need for
    `kinds` (counts per --mix kind) by PIPE_CLASSES' model -- the most any set of pipes must
    carry over its width -- and the count per class (memory operands added to their port's)."""
    per: dict[str, float] = collections.defaultdict(float)
    for kind, n in kinds.items():
        cls = pipe_class(kind)
        per[cls] += n
        if cls in ("load", "load stack", "broadcast", "store", "move", "scalar"):
            continue
        if "1toN" in kind:
            per["broadcast"] += n
        elif "load" in kind:
            per["load stack" if "stack" in kind else "load"] += n
        elif "store" in kind:
            per["store"] += n
    mul, shuf, conv, anyk = (per[c] for c in ("mul", "shuffle", "shift/convert", "any"))
    vector = max(mul / 2, shuf / 2, conv / 2, (mul + shuf) / 3, (shuf + conv) / 3, (mul + shuf + conv + anyk) / 4)
    ports = per["load stack"] + (per["load"] + per["broadcast"]) / 2
    return max(vector, ports, per["store"]), dict(per)


def located(counts: collections.Counter, info: dict, maps: str):
    """(group, offset in the kernel library or None, count) for every counted address: the
    kernel library's symbols by group_of, every other library by its file's name."""
    lib = info["lib"]
    real = os.path.realpath(lib)
    regions = mappings(maps)
    base = library_base(info, maps)
    syms = symbols(lib)
    for pc, c in counts.items():
        where = next((path for start, end, _, path in regions if start <= pc < end), "?")
        if os.path.realpath(where) != real:
            yield os.path.basename(where).split(".so")[0] or "?", None, c
            continue
        name = symbol_at(syms, pc - base)
        yield (group_of(name) if name else "driver"), pc - base, c


def charge(counts: collections.Counter, info: dict, maps: str) -> dict[str, list[int]]:
    """Group -> [instructions, multiply-adds, vector instructions]."""
    ops = mnemonics(info["lib"])
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for group, off, c in located(counts, info, maps):
        out[group][0] += c
        op = ops.get(off, "") if off is not None else ""
        out[group][1] += c if MADD.match(op) else 0
        out[group][2] += c if op.startswith("v") else 0  # AVX / AVX-512 (VEX, EVEX): the vector units' share
    return out


def by_kind(counts: collections.Counter, info: dict, maps: str) -> dict[str, collections.Counter]:
    """Group (scores, values, driver) -> instruction kind (kind_of) -> count."""
    code = disassembly(info["lib"])
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for group, off, c in located(counts, info, maps):
        if off is not None:
            out[group][kind_of(*code.get(off, ("?", "")))] += c
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
        return
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        sys.exit("kernel_instructions.py counts x86-64 instructions under Linux ptrace: not this machine")
    for tool in ("nm", "objdump"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is missing: install binutils")
    lines = None
    if "--lines" in sys.argv:  # --lines SYMBOL: that kernel's counts by source line, at the last context
        at = sys.argv.index("--lines")
        lines = sys.argv[at + 1]
        del sys.argv[at : at + 2]
        os.environ["MINILLAMA_LINE_TABLES"] = "1"  # the same code with -g: addr2line finds its lines
        if shutil.which("addr2line") is None:
            sys.exit("addr2line is missing: install binutils")
    mix = "--mix" in sys.argv  # --mix: each group's instructions by kind, per KV token (the slope)
    if mix:
        sys.argv.remove("--mix")
    line_counts: dict[str, collections.Counter] = {}
    contexts = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "2048,4096").split(",")]
    specs = (sys.argv[2] if len(sys.argv) > 2 else "fp16;hadv2").split(";")
    shape = sys.argv[3] if len(sys.argv) > 3 else "smollm2"
    groups = ["scores", "values", "driver"]
    printed = False
    for kv in specs:
        per, kinds = {}, {}
        for n in contexts:
            counts, info, maps = trace(n, kv, shape)
            per[n] = charge(counts, info, maps)
            if mix:
                kinds[n] = by_kind(counts, info, maps)
            if lines and n == contexts[-1]:
                line_counts[kv] = by_line(counts, info, maps, lines)
            heads = info["heads"]
            if not printed:
                print(f"{info['describe']}; {shape} layer shape; one thread; contexts {contexts}")
                print("instructions per held token and KV head (vector: AVX/AVX-512 ones; madd: multiply-adds)")
                printed = True
        for counts in per.values():  # every other library (OpenMP, libc, the loader) as one
            rest = [g for g in list(counts) if g not in groups]
            popped = [counts.pop(g) for g in rest]
            counts["other"] = [sum(c[k] for c in popped) for k in range(3)]
        names = [*groups, "other"]
        lo, hi = contexts[0], contexts[-1]
        units = (hi - lo) * heads if hi > lo else hi * heads

        def slope(g: str, k: int) -> float:
            return ((per[hi][g][k] - per[lo][g][k]) if hi > lo else per[hi][g][k]) / units

        total = sum(slope(g, 0) for g in names)
        fixed = sum(per[lo][g][0] for g in names) - total * lo * heads if hi > lo else 0
        cells = "  ".join(
            f"{g} {slope(g, 0):5.1f} ({slope(g, 2):4.1f} vector, {slope(g, 1):4.1f} madd)" for g in groups
        )
        print(f"{kv:10s} {cells}  other {slope('other', 0):.1f}  total {total:5.1f}  fixed {fixed / 1e3:.1f} k")
        for g in groups if mix else []:
            grown = collections.Counter(
                {k: (kinds[hi][g][k] - (kinds[lo][g][k] if hi > lo else 0)) / units for k in kinds[hi][g]}
            )
            top = [f"{k} {v:.2f}" for k, v in grown.most_common() if v >= 0.05]
            print(f"  {g}: " + "; ".join(top))
            bound, per_class = pipe_cycles(grown)
            print(
                f"  {g} by pipe class: "
                + ", ".join(f"{c} {per_class.get(c, 0):.1f}" for c in CLASSES)
                + f"; the pipes and ports need >= {bound:.1f} cycles a KV token"
            )
        if kv in line_counts:
            print(f"  {lines} by source line, instructions per KV token at {hi} tokens (call total, not a slope):")
            for where, c in line_counts[kv].most_common(30):
                file, _, number = where.rpartition(":")
                source = source_lines(Path(file).name)
                text = (
                    source[int(number) - 1].strip()[:90] if number.isdigit() and 0 < int(number) <= len(source) else ""
                )
                print(f"  {c / (hi * heads):6.2f}  {Path(where).name:28s} {text}")


if __name__ == "__main__":
    main()
