"""What the model may touch in a KV cache: the ``Cache`` protocol and the views it hands out.

The model (model/llama.py, model/attention.py) uses a cache only through these names, as
gpt-fast's model uses ``KVCache.update`` and mlx-lm's ``offset``/``update_and_fetch``:

    cache.next_position        the next token's position (RoPE angles of the queries from it on)
    cache.pre_rope             keys are stored before RoPE (rotated for their positions when read)
    cache.held                 how many tokens are stored
    cache.layer(i)             a LayerView: what attention reads of layer i
    cache.append(new_kv)       the one place the cache grows (and evicts)

A ``LayerView`` gives the codecs of keys and values (their storage spaces), the key center,
the held tokens' positions and ``read(dtype)``: the held keys and values, dequantized, counted
as read. Nothing else of the cache's insides (rings, stores, counters) reaches the model.

``kv/cache.py: KVCache`` implements the protocol; ``tests/fakes.py: ListCache`` is the
smallest cache that does (plain lists of exact tensors), the oracle the tests compare with.
"""

from __future__ import annotations

from typing import Protocol

import torch

from minillama.kv.codecs import Codec


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


class Cache(Protocol):
    """Everything the model touches in a KV cache (see the module docstring)."""

    @property
    def held(self) -> int: ...

    @property
    def pre_rope(self) -> bool: ...

    @property
    def next_position(self) -> int: ...

    def layer(self, i: int) -> LayerView: ...

    def append(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None: ...
