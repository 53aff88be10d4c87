"""What the model may touch in a KV cache: the ``Cache`` protocol and the views it hands out.

The model (model/llama.py, model/attention.py) uses a cache only through these names, as
gpt-fast's model uses ``KVCache.update`` and mlx-lm's ``offset``/``update_and_fetch``:

    cache.next_position        the next token's position (RoPE angles of the queries from it on)
    cache.pre_rope             keys are stored before RoPE (rotated for their positions when read)
    cache.held                 how many tokens are stored
    cache.layer(i)             a LayerView: what attention reads of layer i
    cache.wants_queries        how many of each layer's newest queries the next append needs (0 but
                               for a cache that chooses its codecs from them: bits=auto, kv/auto.py)
    cache.append(new_kv, probes)   the one place the cache grows (and evicts); probes, one ``Probe``
                               a layer, only when the cache asked for them

A ``LayerView`` gives the codecs of keys and values (their storage spaces), the key center,
the held tokens' positions, ``read(dtype)`` for the reference attention (dequantized, counted
as read) and ``parts()`` for the kernels: each held part (sinks, quantized body, tier, residual) of
each tensor, its rings as ``RingView`` (a buffer and the slot of its oldest row); a kernel that
has read them says so with ``count_kernel_read()``. Nothing else of the cache's insides (rings,
stores, counters) reaches the model.

``kv/cache.py: KVCache`` implements the protocol; ``tests/fakes.py: ListCache`` is the
smallest cache that does (plain lists of exact tensors), the oracle the tests compare with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from minillama.kv.codecs import Codec


@dataclass(frozen=True)
class RingView:
    """A ring of rows as the kernels read it: logical row i is buf[:, :, (start + i) % slots]."""

    buf: torch.Tensor  # (B, H, slots, width)
    start: int  # slot of the oldest row


@dataclass(frozen=True)
class PartView:
    """One held part of one tensor of one layer: n consecutive tokens at positions first_position..."""

    name: str  # "sinks" | "body" | "tier" | "residual"
    n: int  # tokens held in this part
    first_position: int  # position of its first token (positions are consecutive inside a part)
    codec: Codec  # how its rows are stored: the tensor's codec for the body, an exact float codec otherwise
    group: int
    rings: dict[str, RingView]  # the codec's parts by name ("values" for exact rows; "codes", "scale", ...)


@dataclass(frozen=True)
class Probe:
    """What a cache that chooses its codecs (``wants_queries``) is handed for one layer with its first
    append: the layer's newest queries, and how much an error in its attention output weighs."""

    queries: torch.Tensor  # (B, Hq, m, D): the newest m queries, after RoPE (rotated as the stored keys)
    # ||o_proj||_F^2 / the median over the tokens of ||x||^2, x the residual stream entering the layer:
    # an output error e reaches the stream as o_proj(e), and the next RMSNorm divides it by ||x||
    weight: float


class LayerView(Protocol):
    """What attention reads of one layer."""

    k_codec: Codec  # the keys' storage space: k_codec.to_space() maps plain keys into it
    v_codec: Codec  # the values' storage space
    key_center: torch.Tensor | None  # (B, H, 1, D) subtracted from the stored keys (center=1), or None

    def positions(self, device=None) -> torch.Tensor:
        """Positions of the held tokens in age order (held,)."""
        ...

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Held keys and values, each (B, H, held, D), dequantized, in storage space (counted as read)."""
        ...

    def parts(self) -> tuple[list[PartView], list[PartView]]:
        """The held parts of keys and of values, for kernels that read them in place."""
        ...

    def count_kernel_read(self) -> None:
        """A kernel has read every held part in place: count those bytes as read."""
        ...


class Cache(Protocol):
    """Everything the model touches in a KV cache (see the module docstring)."""

    @property
    def held(self) -> int: ...

    @property
    def pre_rope(self) -> bool: ...

    @property
    def next_position(self) -> int: ...

    @property
    def wants_queries(self) -> int: ...

    def layer(self, i: int) -> LayerView: ...

    def append(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]], probes: list[Probe] | None = None) -> None: ...
