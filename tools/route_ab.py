"""One part's block kernel on the integer route against the exact one, in turn, in one process.

    OMP_NUM_THREADS=1 python tools/route_ab.py values 8192 "k=int4c,v=lm2h,group=64,residual=32" 15
    OMP_NUM_THREADS=1 python tools/route_ab.py scores 8192 "k=int3h,v=lm2h,group=64,residual=8" 15

The default model's layer shape (3 KV heads, 3 query heads each, head_dim 64), synthetic fill.
For each spec (';'-separated, as tools/attention_rounds.py takes them) the body part of the keys
(``scores``) or values (``values``) is read by ``attend_one_part`` via ``Route.INTEGER`` and via
the exact route (``TOKEN``, or ``CHANNEL`` for KIVI keys), alternating round by round; it prints
each route's median in ns per held token and KV head, or why the route refused the rows. The
part is reused, so it sits in the L2/L3 caches: compute, not DRAM. This is how a new integer
kernel is judged against the float kernel it would replace (docs/speed.md).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from attention_rounds import spec_list  # tools/ is the script's folder, so on sys.path

from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.native import backend
from minillama.native.abi import NotSupported, Route
from minillama.native.plans import attend_one_part, held_parts
from minillama.native.write import writer

H, R, D = 3, 3, 64


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[1] not in ("scores", "values"):
        sys.exit(__doc__)
    values, n = sys.argv[1] == "values", int(sys.argv[2])
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 15
    lib = backend.library()
    if lib is None:
        sys.exit(f"the kernels are not in use: {backend.describe()}")
    print(f"{backend.describe()}; {sys.argv[1]}; {n} tokens; median of {rounds} rounds (ns per token and KV head)")
    for kv in spec_list(sys.argv[3]):
        cache = KVCache(parse_kv(kv), n_layers=1, n_kv_heads=H, head_dim=D, capacity=n + 64)
        fill_synthetic(cache, n, writer=writer())
        k_parts, v_parts = held_parts(cache.layer(0))
        part = next(p for p in (v_parts if values else k_parts) if p.name == "body")
        if values:
            x, out = torch.softmax(torch.randn(1, H, R, part.n), -1), torch.zeros(1, H, R, D)  # p; o
        else:
            x, out = torch.randn(1, H, R, D), torch.empty(1, H, R, part.n)  # q; scores
        exact = Route.CHANNEL if part.codec.row_kind.name == "CHANNEL" else Route.TOKEN
        times: dict[Route, list[float] | str] = {Route.INTEGER: [], exact: []}
        for _ in range(rounds):
            for via, got in times.items():
                if isinstance(got, str):
                    continue
                try:
                    t0 = time.perf_counter()
                    attend_one_part(lib, values, part, x, out, via=via)
                    got.append((time.perf_counter() - t0) / (part.n * H))
                except NotSupported as e:
                    times[via] = f"refused ({e})"
        shown = [
            f"{via.name.lower()} {got if isinstance(got, str) else f'{statistics.median(got) * 1e9:.1f} ns'}"
            for via, got in times.items()
        ]
        print(f"{kv:45s} " + "  ".join(shown))


if __name__ == "__main__":
    main()
