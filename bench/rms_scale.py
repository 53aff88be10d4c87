"""Any ``minillama`` command with the Lloyd-Max codecs' scales left at each group's RMS (no refinement).

    python bench/rms_scale.py needle --lengths 8192 --depths 0.9 --trials 9 --seed 3 \\
        --kv "k=lm4hb,v=fp16,group=64,residual=8,sinks=4,center=1" --json
    python bench/rms_scale.py ppl --dataset hamlet --windows 4 --kv fp16 --kv k3v2mixt --no-blind --json

A codebook codec (``lm*``) starts each group's scale at its RMS and refines it REFINE times by
least squares (kv/quantize.py: quantize_codebook; native/encode.cpp alike): the refined scale
<x, l> / <l, l> fits each group's squared error best, and being a projection it returns each coded
row with less energy than it had (<x, l>^2 / <l, l> <= |x|^2). Centered
Lloyd-Max keys lose the deep passkey (docs/quality.md, "Passkey at depth 0.9"); this runs a
command with the refinement off (REFINE = 0, in the reference and the kernels' encoders alike)
to ask whether that shrink is why.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import minillama.kv.quantize as quantize
import minillama.kv.token_write as token_write
import minillama.kv.write as write
from minillama.app.cli import cli


@contextmanager
def rms_scales():
    """Within it, every codebook encoder (the reference's and the kernels') leaves each group's
    scale at its RMS: REFINE = 0 where the writers read it, and the reference's default."""
    saved = [m.REFINE for m in (quantize, write, token_write)], quantize.quantize_codebook.__defaults__
    for module in (quantize, write, token_write):
        module.REFINE = 0
    quantize.quantize_codebook.__defaults__ = (0, False)  # (refine, log_scale)
    try:
        yield
    finally:
        for module, refine in zip((quantize, write, token_write), saved[0]):
            module.REFINE = refine
        quantize.quantize_codebook.__defaults__ = saved[1]


if __name__ == "__main__":
    with rms_scales():
        cli(sys.argv[1:], standalone_mode=True)
