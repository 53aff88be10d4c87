"""Decode and prefill beside busy processes: minillama and llama.cpp, measured the same way.

    python bench/load_check.py                       # 3 rounds; alone, 1 and 2 busy processes
    python bench/load_check.py --rounds 5 --json bench/results/load_check.json

A busy process is `python -c "while True: pass"`: what a browser tab or a build does to a
laptop's core. Each round runs every condition in turn (alone, then beside 1, then 2 busy
processes) and, inside a condition, each engine in turn, both on the GGUF the default model
comes from: minillama (its Q4_1 blocks in place as `generate` and `chat` run them, fp16 cache,
its thread chooser on) and llama.cpp through llama-cpp-python (its default thread count of 2,
K/V f16, flash attention). Decode: --steps greedy tokens after a prefill of --context tokens; prefill: --context
tokens from an empty cache. Reported: each engine's median tokens/s per condition and its
share of its own alone speed (issue: with one busy process, decode keeps >= 60%). Needs
`pip install -e ".[llamacpp]"` for llama.cpp; without it only minillama is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from peers import llama_cpp_decoder, llama_cpp_prefiller, minillama_decoder, minillama_prefiller


def start_busy(n: int) -> list[subprocess.Popen]:
    """n CPU-bound processes, each spinning on one core until stopped."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(0.5)  # scheduled and spinning before anything is timed
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128, help="decode tokens timed per engine and condition")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", default="0,1,2", help="busy-process counts to run beside, comma-separated")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args()
    counts = [int(c) for c in args.busy.split(",")]

    from minillama.app.default_model import fetch_default, find_gguf
    from minillama.app.options import read_text
    from minillama.model.tokenizer import load_tokenizer
    from minillama.native import backend

    backend.adapt_threads()  # as generate and chat decode
    folder, gguf = fetch_default(), find_gguf(install=False)
    ids = load_tokenizer(folder).encode(read_text(None, "hamlet"))
    room = args.steps * (len(counts) * args.rounds + 1)
    engines = {"minillama": (minillama_decoder(gguf, ids, args.context, args.steps, room)[0],)}
    engines["minillama"] += (minillama_prefiller(gguf, ids, args.context),)
    decoder = llama_cpp_decoder(gguf, ids, args.context, args.steps, room)
    if decoder is not None:
        engines["llama.cpp"] = (decoder, llama_cpp_prefiller(gguf, ids, args.context))
    rates: dict[tuple[str, str, int], list[float]] = {}
    for r in range(args.rounds):
        for n in counts:
            procs = start_busy(n)
            try:
                for phase, index in (("decode", 0), ("prefill", 1)):
                    for name, runs in engines.items():
                        rate = runs[index]()
                        rates.setdefault((name, phase, n), []).append(rate)
                        print(f"round {r + 1}: {name} {phase} beside {n} busy: {rate:.1f} tok/s", file=sys.stderr)
            finally:
                stop(procs)

    rows = []
    for name in engines:
        for phase in ("decode", "prefill"):
            alone = statistics.median(rates[(name, phase, counts[0])])
            for n in counts:
                seen = rates[(name, phase, n)]
                rows.append(
                    {
                        "engine": name,
                        "phase": phase,
                        "busy": n,
                        "tokens_per_s": statistics.median(seen),
                        "min": min(seen),
                        "max": max(seen),
                        "share_of_alone": statistics.median(seen) / alone,
                        "context": args.context,
                        "rounds": args.rounds,
                    }
                )
    print(f"{'engine':<11}{'phase':<9}{'busy':>5}{'tok/s':>9}{'min':>9}{'max':>9}{'of alone':>10}")
    for row in rows:
        print(
            f"{row['engine']:<11}{row['phase']:<9}{row['busy']:>5}{row['tokens_per_s']:>9.1f}{row['min']:>9.1f}"
            f"{row['max']:>9.1f}{100 * row['share_of_alone']:>9.0f}%"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
