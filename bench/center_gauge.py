"""What subtracting a per-sequence channel mean would buy each tensor's codec (issue 28, a gauge).

    python bench/center_gauge.py lm2h,lm3h,lm4h,int2h
    python bench/center_gauge.py lm3h --text wiki.test.raw     # any text file

Keys can be stored centered (``center=1``: the channel mean of the first write, a prefill,
subtracted before the rotation and added back through the query); values never are. This
measures, before building anything, what a center would do to each codec's round trip on the
default model's keys and values of every layer over one prefill (an fp32 cache, the reference
backend): the relative squared error sum |x' - x|^2 / sum |x|^2 (in the codec's storage space,
groups of 64 channels, averaged over layers) as stored today, centered by the mean of the first
``--first`` tokens (what a cache knows at its first write: the prefill of a perplexity window),
and centered by the mean of all of them (a bound: no cache knows it when it writes). A center is
one row of D numbers per head and layer and sequence, so it costs no bits an element worth
counting; what it buys is what this prints. Nothing here is a codec.
"""

from __future__ import annotations

import torch
from outlier_gauge import gauge_arguments, prefill_layers  # bench/ is the script's folder, so on sys.path

from minillama.kv.codecs import CODECS

GROUP = 64


def relative_error(codec, x: torch.Tensor, center: torch.Tensor) -> float:
    """x (B, H, T, D) stored as x - center (center (B, H, 1, D)) -> the round trip's squared error
    over the energy of x as stored without a center (so the columns compare)."""
    stored = codec.to_space(x - center)  # (B, H, T, D)
    decoded = codec.decode(codec.encode(stored, GROUP), GROUP, x.shape[-1])
    return ((decoded - stored) ** 2).sum().item() / (codec.to_space(x) ** 2).sum().item()


def main() -> None:
    ap = gauge_arguments(__doc__)
    ap.add_argument("--first", type=int, default=128, help="the tokens a cache's first write sees")
    args = ap.parse_args()
    lm, ids, layers = prefill_layers(args)  # [(k, v)] (1, H, T, D) each
    print(f"{lm.name}, {args.text or args.dataset}, {len(ids)} tokens, groups of {GROUP}; relative squared error")
    for name in args.codecs.split(","):
        if name not in CODECS:
            raise SystemExit(f"unknown codec {name!r}: see minillama kv --list")
        codec = CODECS[name]
        for t, tensor in (("k", 0), ("v", 1)):
            plain = first = whole = share = 0.0
            for kv in layers:
                x = kv[tensor]  # (1, H, T, D)
                mean = x.mean(2, keepdim=True)  # (1, H, 1, D)
                plain += relative_error(codec, x, torch.zeros_like(mean))
                first += relative_error(codec, x, x[:, :, : args.first].mean(2, keepdim=True))
                whole += relative_error(codec, x, mean)
                share += ((mean**2).sum() * x.shape[2] / (x**2).sum()).item()  # the mean's share of the energy
            n = len(layers)
            print(
                f"{name:8s} {t}: as stored {plain / n:.4f}  centered on the first {args.first} {first / n:.4f} "
                f"({first / plain:.2f}x)  on all {whole / n:.4f} ({whole / plain:.2f}x)  the mean's share of the energy {share / n:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
