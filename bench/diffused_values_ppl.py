"""Value codes whose errors cancel along the tokens (error diffusion): emulated on the cached path.

    python bench/diffused_values_ppl.py hamlet 1                     # values only, Hamlet W 1 (N 896, P 128)
    python bench/diffused_values_ppl.py --text FILE 1                # any UTF-8 text
    python bench/diffused_values_ppl.py hamlet 1 --weights 25,50,75  # the carry's weights, in hundredths
    python bench/diffused_values_ppl.py hamlet 1 --keys lm3h         # beside 3-bit keys (k3v2lm's)
    python bench/diffused_values_ppl.py hamlet 4 --mix k3v2mixb       # a preset, its 2-bit values diffused

An attention output is a weighted sum of value rows, o = sum_t p_t v_t, so what a value code's
error costs is sum_t p_t e_t, not each e_t alone. Coding the rows in token order and carrying
each row's error into the next one before it is coded (first-order noise shaping, as error
diffusion does for images), e_t = n_t - a n_(t-1), turns that into sum_t n_t (p_t - a p_(t+1)):
nearly nothing where attention is spread over neighbouring tokens, up to (1 + a^2) times the
plain code's where it falls on one token alone. Which of the two the model's heads are, only
the cached path can say. No bit is added: the carry lives in the encoder, not the cache.

``lm{b}d{a}`` (a: the carry's weight in hundredths, d100 carries all of it, d50 half; default
100 and 50) is lm{b}h's code (Hadamard rotation, Gaussian Lloyd-Max levels, a refined fp16
scale per group of 64) applied to x_t + a carry, in the rotated space the cache stores, with
carry = that input minus its decode;
one carry per layer, sequence, head and channel, kept across the encoder's calls (every flush
codes all layers in one call, in token order; a flush of more than one token, the prefill's,
starts a new sequence). The stand-in keeps the decoded rows as float32 and no kernel reads it
(the step takes the PyTorch path); bits an element are lm{b}h's, b + 16/64. Rows: fp16; keys
fp16 (or ``--keys CODEC``) with values lm{b}h and lm{b}d{a} for b = 2 and 3 (the values alone;
group 64, residual 8, 4 sinks). With ``--mix PRESET`` the rows are fp16, the preset, and the
preset with every 2-bit value layer (lm2hb, one-byte scales) coded as lm2db{a} (the same with
the carry; the lever the W 1 rows chose, a = 25 unless ``--weights``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from standin import DecodedRows, cached_path_rows, text_of  # bench/ is on sys.path

from minillama.kv.codecs import CODECS
from minillama.kv.quantize import dequantize_codebook, quantize_codebook
from minillama.kv.spec import MIXES

TAIL = "group=64,residual=8,sinks=4"


def diffuse(
    x: torch.Tensor, carry: torch.Tensor, bits: int, group: int, weight: float, log_scale: bool = False
) -> torch.Tensor:
    """x (N, H, T, D) coded token by token with `weight` of the running error carried into the next
    token (scales as lm{bits}h's, or with `log_scale` lm{bits}hb's); carry (N, H, D) float32 is
    updated in place. Returns the decoded rows (N, H, T, D) float32."""
    out = torch.empty(x.shape, dtype=torch.float32)
    for t in range(x.shape[2]):
        target = x[:, :, t].float() + weight * carry  # (N, H, D)
        codes, scale = quantize_codebook(target.to(x.dtype).unsqueeze(2), bits, group, log_scale=log_scale)
        decoded = dequantize_codebook(codes, scale, bits, group).float()[:, :, 0]  # (N, H, D)
        carry.copy_(target - decoded)
        out[:, :, t] = decoded
    return out


@dataclass(frozen=True)
class Diffused(DecodedRows):
    """A stand-in: lm{bits}h values coded in token order with `weight` of the error carried on."""

    weight: float = 1.0
    carries: dict = field(default_factory=dict, compare=False, hash=False)  # (N, H, D) shape -> carry

    def encode(self, x, group, params=None):
        key = (x.shape[0], x.shape[1], x.shape[3])
        if x.shape[2] > 1 or key not in self.carries:  # the prefill's flush: a new sequence
            self.carries[key] = torch.zeros(key)
        return {"values": diffuse(x, self.carries[key], self.bits, group, self.weight, self.log_scale)}


def main() -> None:
    args = sys.argv[1:]
    weights = [100, 50]
    if "--weights" in args:
        at = args.index("--weights")
        weights = [int(w) for w in args[at + 1].split(",")]
        del args[at : at + 2]
    keys = "fp16"
    mix = None
    if "--mix" in args:
        at = args.index("--mix")
        mix = args[at + 1]
        del args[at : at + 2]
    if "--keys" in args:
        at = args.index("--keys")
        keys = args[at + 1]
        del args[at : at + 2]
    if len(args) < 2:
        sys.exit(__doc__)
    windows = int(args[-1])
    text = text_of(args)
    values = []
    for bits in (2, 3):
        values.append(f"lm{bits}h")
        for hundredths in weights:
            name = f"lm{bits}d{hundredths}"
            CODECS[name] = Diffused(name, bits, "stand-in", rotate=True, weight=hundredths / 100)
            values.append(name)
    specs = ["fp16"] + [f"k={keys},v={v},{TAIL}" for v in values]
    labels = list(specs)
    if mix is not None:
        preset = MIXES[mix]
        specs, labels = ["fp16", preset], ["fp16", mix]
        for hundredths in weights if "--weights" in sys.argv else [25]:
            name = f"lm2db{hundredths}"
            CODECS[name] = Diffused(name, 2, "stand-in", rotate=True, weight=hundredths / 100, log_scale=True)
            specs.append(preset.replace("v=lm2hb,", f"v={name},").replace("/lm2hb", f"/{name}"))
            labels.append(f"{mix}, its 2-bit values as {name}")
    rows = cached_path_rows(specs, text, windows)
    for r, label in zip(rows, labels):
        print(f"  {label:44s} ppl {r.ppl:.4f}  Δ {r.delta_pct:+.2f}%  KLD {r.kld_mean:.5f}", flush=True)


if __name__ == "__main__":
    main()
