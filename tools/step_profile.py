"""Where the milliseconds of one decode step go (default model unless --model).

    python tools/step_profile.py --context 512 --kv fp16
    python tools/step_profile.py --context 8192 --kv hadv2 --fill synthetic
    python tools/step_profile.py --context 512 --kv fp16 --rounds 9   # the roofline as a median

One step on the kernels backend is: Python takes the token and position (model/llama.py: _run)
and refreshes the cache's description of its layers (native/plans.py: CachePlans); one
native call runs the embedding row, every layer (native/step.cpp: norm, q/k/v, RoPE, attention,
o, norm, gate/up, SiLU, down), the final norm and the LM head; every layer's new keys and values
are appended to the cache (kv/layered.py, encoding them: kv/write.py). The script times each of
those wrappers over real steps; the native call itself adds the wall time of its projections,
attention, the rest and the head to counters when asked (native/step.cpp: LayerStep.timing).
Timing wrappers add a few microseconds per call: the total with them is printed beside the
total without.

The roofline share is the bytes a step reads over the measured read bandwidth, divided by the
step's time. On a shared VM both move by a third within minutes, so a step timed at one minute
against a bandwidth probed at another can read anywhere from 40% to 100%. ``--rounds N``
alternates the two, N times (a stretch of steps, then a probe), and prints the median of the
per-round shares with their range: the number a target is judged on.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import torch

from minillama.app.default_model import resolve_model
from minillama.eval.bench import measure_bandwidth, median_ms, projection_ms, weight_bytes_per_token, weight_kinds
from minillama.eval.datasets import load as load_text
from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.model.generate import decode_step, prefill
from minillama.native import backend, ops, step
from minillama.native.fast import load_model
from minillama.native.plans import CachePlans
from minillama.native.token_write import CacheWrites
from minillama.native.write import writer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--kv", default="fp16")
    ap.add_argument("--fill", choices=["prefill", "synthetic"], default="prefill")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=1, help="bandwidth probe + steps, alternated N times")
    args = ap.parse_args()

    lm = load_model(resolve_model(args.model), "bfloat16")
    cfg = lm.config
    cache = KVCache.for_model(cfg, parse_kv(args.kv), args.context + (max(1, args.rounds) + 2) * args.steps + 16)
    ids = lm.tokenizer.encode(load_text("hamlet"))[: args.context]
    if args.fill == "prefill":
        prefill(lm.model, ids, cache)
    else:
        fill_synthetic(cache, args.context, writer=writer())
    token = ids[-1]

    def steps(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            decode_step(lm.model, token, cache)
        return (time.perf_counter() - t0) / n * 1000

    steps(5)
    weights = weight_bytes_per_token(lm.model)
    rounds = []  # (bandwidth B/s, ms per step, bytes a step read): steps, then a probe, in turn
    for _ in range(max(1, args.rounds)):
        ms = statistics.median(steps(args.steps // 4) for _ in range(4))
        rounds.append((measure_bandwidth(), ms, weights + cache.bytes.last_read))
    plain = statistics.median(ms for _, ms, _ in rounds)
    bandwidth = statistics.median(bw for bw, _, _ in rounds)
    read = rounds[-1][2]
    shares = [100 * b / bw * 1000 / ms for bw, ms, b in rounds]  # roofline % of each round

    acc: dict[str, float] = collections.defaultdict(float)

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            acc[name] += time.perf_counter() - t0
            return out

        return wrapper

    ops.decode_step = timed("native step call", ops.decode_step)
    CachePlans.refresh = timed("layer plans (Python)", CachePlans.refresh)
    KVCache.append_stacked = timed("cache append outside the step (PyTorch write)", KVCache.append_stacked)
    CacheWrites.describe = timed("cache write described (Python)", CacheWrites.describe)
    CacheWrites.commit = timed("cache write counted (Python)", CacheWrites.commit)
    steps(3)
    # The phases inside the native call are timed in the same steps as the call itself, so what the
    # call spends outside them (ctypes, the embedding rows) is a difference of nested intervals of
    # one run: never negative, whatever the machine does between runs.
    phases = torch.zeros(5, dtype=torch.float64)  # projections, attention, rest, head, write: s, inside the call
    native = step.native_step(lm.model, backend.library(), 1)
    native.time_phases(phases)
    acc.clear()
    timed_total = steps(args.steps)
    native.time_phases(None)
    parts = {k: v / args.steps * 1000 for k, v in acc.items()}
    proj_in, attn_in, rest_in, head_in, write_in = (float(v) / args.steps * 1000 for v in phases)
    proj = projection_ms(lm.model)
    lm_head = projection_ms_of(lm.model.lm_head)
    print(
        f"{lm.name}, {weight_kinds(lm.model)} weights, kv {args.kv} at {args.context} tokens ({args.fill}); backend {backend.describe()}"
    )
    print(
        f"step {plain:.2f} ms without timers ({timed_total:.2f} ms with); {read / 1e6:.1f} MB read per token "
        f"({weights / 1e6:.1f} MB weights): floor {read / bandwidth * 1000:.2f} ms at the measured "
        f"{bandwidth / 1e9:.1f} GB/s, roofline {statistics.median(shares):.0f}%"
    )
    if len(rounds) > 1:
        print(
            f"  {len(rounds)} rounds (steps, then a probe): roofline median {statistics.median(shares):.0f}% "
            f"(rounds {min(shares):.0f}-{max(shares):.0f}%), steps {min(r[1] for r in rounds):.2f}-"
            f"{max(r[1] for r in rounds):.2f} ms, bandwidth {min(r[0] for r in rounds) / 1e9:.1f}-"
            f"{max(r[0] for r in rounds) / 1e9:.1f} GB/s; median step and bandwidth above"
        )
    native = parts.get("native step call", 0.0)
    rows = [
        ("native step call", native),
        ("  projections (q/k/v, o, gate/up, down)", proj_in),
        ("  attention over the cache", attn_in),
        ("  rest: norms, rounding, RoPE, SiLU, copies", rest_in),
        ("  final norm and LM head", head_in),
        ("  cache write (encode + store the token)", write_in),
        ("  call overhead (ctypes, timers, embedding rows)", native - proj_in - attn_in - rest_in - head_in - write_in),
    ]
    rows += [(k, v) for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if k != "native step call"]
    rows.append(("  of which the LM head's projection (alone)", lm_head))
    rows.append(("(projections alone, outside the step: every layer + LM head)", proj))
    rows.append(("Python between (token, angles, glue)", timed_total - sum(parts.values())))
    for name, ms in rows:
        print(f"  {name:48s} {ms:7.2f} ms")


def projection_ms_of(layer) -> float:
    """Median ms of one product of one row with `layer`'s weight (the kernel a step uses)."""
    lib, kind = backend.library(), getattr(layer, "kind", None)
    x = torch.randn(1, layer.in_features)  # (1, in)
    if lib is None:
        return median_ms(lambda: layer(x.to(layer.weight.dtype if kind is None else x.dtype)), 20)
    int8 = kind is not None and layer.int8 and not backend.exact_arithmetic()  # as FastBlockLinear decides
    return median_ms(lambda: ops.gemm_rows(lib, x, layer.weight, kind, int8), 20)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
