"""What the emulation scripts share: a codec that stores the rows it would decode, and the run
that measures such codecs on the cached path.

A lever for the cache's quality is measured before anyone builds it (outlier_ppl.py,
vector3_ppl.py, transform_keys_ppl.py, qjl_keys_ppl.py, diffused_values_ppl.py): a stand-in codec
encodes a block of rows the way the real codec would, then keeps the decoded rows as float32,
so the attention reads exactly what the real codec would give it. No kernel reads a stand-in
(the decode step takes the PyTorch path), and the cache counts its float32 bytes: each script
states the bits the real codec would spend, computed, not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from minillama.app.default_model import resolve_model
from minillama.eval.datasets import load as load_text
from minillama.eval.perplexity import evaluate
from minillama.kv.codecs import Codebook, PartSpec
from minillama.kv.spec import parse_kv
from minillama.model.loader import load_model


@dataclass(frozen=True)
class DecodedRows(Codebook):
    """A stand-in codec (a subclass writes encode): one part, "values", the decoded rows (..., T, D)
    as float32, which decode returns as they are."""

    row_kind: ClassVar = None  # no kernel reads it: the step takes the PyTorch path

    def parts(self, head_dim: int, group: int) -> list[PartSpec]:
        return [PartSpec("values", torch.float32, head_dim, 1)]

    def decode(self, parts, group, head_dim, params=None):
        return parts["values"].float()


def text_of(args: list[str]) -> str:
    """The evaluated text from a script's arguments: ``--text FILE`` or a dataset's name first."""
    return open(args[1], encoding="utf-8").read() if args[0] == "--text" else load_text(args[0])


def cached_path_rows(specs: list[str], text: str, windows: int, lm=None, tokens: int = 896) -> list:
    """``minillama ppl``'s rows for `specs` on `text` (W `windows`, N `tokens`, P 128; no blind pass),
    the default model in float32 unless `lm` is given."""
    lm = lm or load_model(resolve_model(None), "float32")
    with torch.inference_mode():
        ids = lm.tokenizer.encode(text)
        return evaluate(lm, ids, [parse_kv(s) for s in specs], n=tokens, windows=windows, blind=False)
