"""What exact outliers per row would buy a codec, before building them (issue 28, item 3).

    python bench/outlier_gauge.py lm3h,lm2h,int4h
    python bench/outlier_gauge.py lm3h --dataset wikitext2 --tokens 896
    python bench/outlier_gauge.py lm3h,lm4h --text wiki.test.raw     # any text file
    python bench/outlier_gauge.py lm3h,lm2h --center 128             # keys as center=1 stores them

The default model's keys and values of every layer over one prefill of a text (an fp32 cache,
the reference backend), each codec's round trip (groups of 64 channels) measured as relative
squared error sum |x' - x|^2 / sum |x|^2 in the codec's storage space, averaged over layers:
as it is, and with the k largest |x| of every row (before any rotation) kept exact and added
back after the rest is decoded -- the dense-and-sparse split of KVQuant. An outlier costs its
value and its channel index per row; the script prints the bits per element that costs at
fp16 and at int8 values, and, for scale, what one more code bit does to the same error.
With ``--center N`` the keys are first centered on the channel mean of their first N tokens, as
a cache with ``center=1`` stores them (the mean of its first write, a perplexity window's
prefill): the large, nearly constant channels a mean takes out are then no longer outliers.
Nothing here is a codec: it says whether one is worth building (the built one: kv/outliers.py).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from minillama.app.default_model import resolve_model
from minillama.eval.datasets import load as load_text
from minillama.kv.cache import KVCache
from minillama.kv.codecs import CODECS
from minillama.kv.spec import parse_kv
from minillama.model.generate import prefill
from minillama.model.loader import load_model
from minillama.native import backend

GROUP = 64


def split_outliers(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (rest, sparse), each (..., D): sparse holds the k largest |x| of every row
    (zeros elsewhere), rest the others (zeros there); rest + sparse = x."""
    idx = x.abs().topk(k, dim=-1).indices  # (..., k)
    sparse = torch.zeros_like(x).scatter(-1, idx, torch.gather(x, -1, idx))
    return x - sparse, sparse


def round_trip(codec, x: torch.Tensor, k: int, group: int = GROUP) -> torch.Tensor:
    """x (B, H, T, D) in the model's space -> what `codec` with the k largest |x| of every row kept
    exact would decode, (B, H, T, D) in the codec's storage space (rotated for Hadamard codecs)."""
    rest, sparse = split_outliers(x, k)
    return codec.decode(codec.encode(codec.to_space(rest), group), group, x.shape[-1]) + codec.to_space(sparse)


def relative_error(codec, x: torch.Tensor, k: int) -> float:
    """x (B, H, T, D) -> the round trip's relative squared error with k exact entries per row."""
    stored = codec.to_space(x)  # (B, H, T, D): what the codec's error is measured in
    return ((round_trip(codec, x, k) - stored) ** 2).sum().item() / (stored**2).sum().item()


def gauge_arguments(doc: str) -> argparse.ArgumentParser:
    """The options every gauge takes (this one, bench/center_gauge.py): the codecs, the text."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("codecs", help="comma-separated codec names (minillama kv --list)")
    ap.add_argument("--dataset", default="hamlet")
    ap.add_argument("--text", default=None, help="a text file instead of --dataset")
    ap.add_argument("--tokens", type=int, default=896)
    return ap


def prefill_layers(args: argparse.Namespace) -> tuple:
    """The default model in float32, the token ids of the chosen text, and every layer's keys and
    values [(k, v)], (1, H, T, D) each, over one prefill of them (an fp32 cache, the reference backend)."""
    lm = load_model(resolve_model(None), "float32")
    text = Path(args.text).read_text() if args.text else load_text(args.dataset)
    ids = lm.tokenizer.encode(text)[: args.tokens]
    cache = KVCache.for_model(lm.config, parse_kv("fp32"), len(ids) + 8)
    with backend.using("reference"):
        prefill(lm.model, ids, cache)
    return lm, ids, [cache.layer(i).read(torch.float32) for i in range(cache.n_layers)]


def main() -> None:
    ap = gauge_arguments(__doc__)
    ap.add_argument("--max-k", type=int, default=2, help="outliers per row to try, 1 .. this")
    ap.add_argument("--center", type=int, default=0, help="center the keys on their first N tokens' mean")
    args = ap.parse_args()
    lm, ids, layers = prefill_layers(args)  # [(k, v)] (1, H, T, D) each
    if args.center:
        layers = [(k - k[:, :, : args.center].mean(2, keepdim=True), v) for k, v in layers]
    d = layers[0][0].shape[-1]
    index_bits = math.ceil(math.log2(d))
    print(
        f"{lm.name}, {args.text or args.dataset}, {len(ids)} tokens; head_dim {d}, groups of {GROUP}; relative squared error"
        + (f"; keys centered on their first {args.center} tokens" if args.center else "")
    )
    print(
        f"an outlier per row costs {(16 + index_bits) / d:.3f} bits/element as fp16 + index, {(8 + index_bits) / d:.3f} as int8 + index"
    )
    for name in args.codecs.split(","):
        if name not in CODECS:
            raise SystemExit(f"unknown codec {name!r}: see minillama kv --list")
        codec = CODECS[name]
        for t, tensor in (("k", 0), ("v", 1)):
            errors = [
                sum(relative_error(codec, kv[tensor], k) for kv in layers) / len(layers) for k in range(args.max_k + 1)
            ]
            cells = "  ".join(f"{k}/row {e:.4f} ({e / errors[0]:.2f}x)" for k, e in enumerate(errors) if k)
            print(f"{name:8s} {t}: none {errors[0]:.4f}  {cells}", flush=True)


if __name__ == "__main__":
    main()
