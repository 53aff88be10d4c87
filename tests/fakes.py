"""The smallest cache that satisfies the model's ``Cache`` protocol (kv/interface.py): the oracle.

Every token's keys and values are kept exact (float32) in plain Python lists; after each
append only the first ``sinks`` tokens and the newest ``capacity - sinks`` stay
(StreamingLLM). Keys are stored after RoPE at their absolute positions, or with
``pre_rope=True`` before RoPE, and then with ``slot_positions=True`` each held token takes
its slot as position. Nothing is quantized, packed or preallocated, so a test that compares
``KVCache`` with this compares the ring, eviction and position logic with the obvious thing.
"""

from __future__ import annotations

import torch

from minillama.kv.codecs import CODECS

EXACT = CODECS["fp32"]


class ListLayer:
    """One layer of a ListCache as attention reads it (a LayerView)."""

    k_codec = v_codec = EXACT
    key_center = None

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions: list[int], empty: torch.Tensor):
        self.keys, self.values, self._positions, self.empty = keys, values, positions, empty

    def positions(self, device=None) -> torch.Tensor:
        return torch.tensor(self._positions, dtype=torch.long, device=device)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([self.empty, *self.keys], dim=2)  # (B, H, held, D)
        v = torch.cat([self.empty, *self.values], dim=2)  # (B, H, held, D)
        return k.to(dtype), v.to(dtype)


class ListCache:
    """Exact keys and values in lists, evicting to `capacity` (keeping `sinks`): a Cache."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int = 10**9,
        sinks: int = 0,
        batch: int = 1,
        pre_rope: bool = False,
        slot_positions: bool = False,
    ):
        self.capacity, self.sinks, self.pre_rope, self.slot_positions = capacity, sinks, pre_rope, slot_positions
        self.empty = torch.zeros(batch, n_kv_heads, 0, head_dim)  # (B, H, 0, D)
        self.layers = [([], []) for _ in range(n_layers)]  # per layer: keys, values, one (B, H, 1, D) per token
        self.kept: list[int] = []  # the absolute position of every held token
        self.position = 0  # the absolute position of the next token

    @property
    def held(self) -> int:
        return len(self.kept)

    @property
    def next_position(self) -> int:
        return self.held if self.slot_positions else self.position

    def layer(self, i: int) -> ListLayer:
        positions = list(range(self.held)) if self.slot_positions else self.kept
        return ListLayer(*self.layers[i], positions, self.empty)

    def append(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        n = new_kv[0][0].shape[2]
        for (keys, values), (k, v) in zip(self.layers, new_kv):
            keys.extend(k.float().split(1, dim=2))
            values.extend(v.float().split(1, dim=2))
            while len(keys) > self.capacity:  # evict the oldest token that is not a sink
                del keys[self.sinks], values[self.sinks]
        self.kept += list(range(self.position, self.position + n))
        while len(self.kept) > self.capacity:
            del self.kept[self.sinks]
        self.position += n
