"""Decode-step projections: minillama's skinny-product kernel vs F.linear.

    python bench/linear_micro.py            # one row, bfloat16 weights (a decode step)
    python bench/linear_micro.py 4 float32  # four rows, float32 weights (ppl --windows 4)

For each shape of the default model (q/k/v fused, o, gate/up fused, down, lm_head), enough
distinct weight matrices to overflow the 32 MiB L3 are cycled, so every call streams its
weights from memory as a decode step does; median over 5 passes. The kernel is the native
step's (native/linear.cpp: gemm_rows, through native/ops.py, float32 out before rounding);
without a native build only F.linear is timed.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from minillama.eval.bench import measure_bandwidth
from minillama.native import backend, ops

SHAPES = {
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def per_call_us(f, weights) -> float:
    f(weights[0])
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for w in weights:
            f(w)
        times.append((time.perf_counter() - t0) / len(weights))
    return 1e6 * statistics.median(times)


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.bfloat16
    bandwidth = measure_bandwidth()
    lib = backend.library()
    print(f"{rows} row(s), {dtype} weights; measured read bandwidth {bandwidth / 1e9:.1f} GB/s (x.sum() over 512 MiB)")
    if lib is None:
        print(f"no native kernels here ({backend.describe()}): F.linear only")
    with torch.no_grad():
        for name, (n_out, n_in) in SHAPES.items():
            size = n_out * n_in * dtype.itemsize
            count = max(2, 200_000_000 // size)  # ~200 MB of weights in all
            weights = [torch.randn(n_out, n_in).to(dtype) for _ in range(count)]
            x = torch.randn(rows, n_in).to(dtype)  # (rows, in)
            theirs = per_call_us(lambda w: F.linear(x, w), weights)
            gbs = size / 1e3
            line = f"F.linear {theirs:7.1f} us ({gbs / theirs:5.1f} GB/s)"
            if lib is not None:
                ours = per_call_us(lambda w: ops.gemm_rows(lib, x, w), weights)
                line = (
                    f"kernel {ours:7.1f} us ({gbs / ours:5.1f} GB/s, "
                    f"{100 * size / (ours * 1e-6) / bandwidth:3.0f}% of measured), {line}, {theirs / ours:.2f}x"
                )
            print(f"{name:10s} {n_out}x{n_in}: {line}")


if __name__ == "__main__":
    main()
