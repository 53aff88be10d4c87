"""Cached-path perplexity with each window in a cache of its own: a spec that chooses per sequence
(``bits=auto:B``, kv/auto.py) then chooses from each window's own prefill.

    python bench/own_window_ppl.py --dataset hamlet --windows 4 --kv fp16 --kv k3v2mixt \\
        --kv "bits=auto:2.73,group=64,residual=8,sinks=4,center=1,tier=56:lm4hb"
    python bench/own_window_ppl.py --text FILE --tokens 2048 --windows 1 --kv ... --json

``minillama ppl --windows W`` decodes the W windows as rows of one batch, one cache a scheme, so
an auto cache there chooses once from all W prefills together. This runs the windows one at a time
(``evaluate`` with one window at offset i x N) and pools them as ``ppl`` would: the perplexity is
exp of the mean negative log-likelihood (the windows score equal token counts, so the geometric
mean of their perplexities), KLD and bits the means of the windows'. For a spec with a fixed
choice the pooled numbers equal ``minillama ppl``'s W-window run up to float rounding.
"""

from __future__ import annotations

import argparse
import json
import math

from minillama.app.options import load, read_text
from minillama.eval.perplexity import evaluate
from minillama.kv.spec import parse_kv


def own_windows(lm, ids: list[int], specs: list, n: int, prefill: int, windows: int) -> list[dict]:
    """Each spec's rows pooled over `windows` consecutive windows of `n` tokens, each window run
    alone (module doc); the first spec is the baseline of ``delta_pct``."""
    per_window = [evaluate(lm, ids, specs, n, prefill, offset=i * n, windows=1, blind=False) for i in range(windows)]
    rows = []
    for j, spec in enumerate(specs):
        mine = [results[j] for results in per_window]
        rows.append(
            {
                "kv": str(spec),
                "ppl": math.exp(sum(math.log(r.ppl) for r in mine) / len(mine)),
                "kld_mean": sum(r.kld_mean for r in mine) / len(mine),
                "bits_per_element": sum(r.bits_per_element for r in mine) / len(mine),
                "windows_ppl": [r.ppl for r in mine],
                "windows_kld": [r.kld_mean for r in mine],
                "tokens": n,
                "prefill": prefill,
                "windows": windows,
            }
        )
    for r in rows:
        r["delta_pct"] = 100 * (r["ppl"] / rows[0]["ppl"] - 1)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", choices=["hamlet", "wikitext2", "pydoc"])
    ap.add_argument("--text", help="a UTF-8 text file instead of --dataset")
    ap.add_argument("--tokens", type=int, default=896)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--kv", action="append", required=True, help="a spec (repeatable); the first is the baseline")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lm = load(None, "float32", "cpu")
    ids = lm.tokenizer.encode(read_text(args.text, args.dataset))
    rows = own_windows(lm, ids, [parse_kv(s) for s in args.kv], args.tokens, args.prefill, args.windows)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"each of {args.windows} window(s) of {args.tokens} tokens (prefill {args.prefill}) in its own cache")
    print(f"{'kv':<60} {'bits':>6} {'ppl':>9} {'delta':>8} {'KLD':>9}  windows' KLD")
    for r in rows:
        klds = " ".join(f"{k:.4f}" for k in r["windows_kld"])
        print(
            f"{r['kv']:<60} {r['bits_per_element']:>6.3f} {r['ppl']:>9.4f} {r['delta_pct']:>+7.2f}% "
            f"{r['kld_mean']:>9.5f}  {klds}"
        )


if __name__ == "__main__":
    main()
