"""Several caches decoded as one batch: the rows of a ``CacheGroup`` are its caches' rows in turn.

An evaluation that compares KV schemes runs the same tokens through one cache per scheme.
Decoding them one after another reads every weight of the model once per scheme and step;
decoding them as rows of one batch reads each weight once per step for all of them (the
weights dominate a small model's step). Each cache keeps its own codecs; a layer of the group
reads every cache's keys and values back into plain space (``GroupView``), so attention needs no
codec of its own for it, and a row's result is what its cache alone would give, up to the float
rounding of a larger batch.

The caches must be alike in everything the model sees of them as a whole: positions (same
held count, same position rules) and whether keys are stored before RoPE.
"""

from __future__ import annotations

import torch

from minillama.errors import UserError
from minillama.kv.cache import KVCache
from minillama.kv.codecs import CODECS, plain_keys
from minillama.kv.interface import LayerView
from minillama.kv.write import REFERENCE, Writer

PLAIN = CODECS["fp32"]  # the identity storage space


class GroupView:
    """One layer of every cache of a group (kv/interface.py: LayerView), read in plain space."""

    k_codec = v_codec = PLAIN
    key_center = None

    def __init__(self, views: list[LayerView]):
        self.views = views

    def positions(self, device=None) -> torch.Tensor:
        return self.views[0].positions(device)  # (held,): alike in every cache of a group

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cache's held keys and values, each (sum of batches, H, held, D), in plain space:
        un-rotated, the key center added back."""
        keys, values = [], []
        for view in self.views:
            k, v = view.read(torch.float32)  # (B_i, H, held, D) each, in the cache's storage space
            keys.append(plain_keys(k, view.k_codec, view.key_center))
            values.append(view.v_codec.from_space(v))
        return torch.cat(keys).to(dtype), torch.cat(values).to(dtype)


class CacheGroup:
    """The Cache protocol over several KVCaches of equal length, their batches stacked in order."""

    def __init__(self, caches: list[KVCache]):
        if not caches:
            raise UserError("a cache group needs at least one cache")
        first = caches[0]
        for c in caches[1:]:
            if (c.held, c.position, c.spec.positions, c.pre_rope) != (
                first.held,
                first.position,
                first.spec.positions,
                first.pre_rope,
            ):
                raise UserError(
                    f"caches {first.spec} and {c.spec} differ in length or positions: they cannot share a batch"
                )
        self.caches = caches
        self.rows = [c.batch for c in caches]

    @property
    def batch(self) -> int:
        return sum(self.rows)

    @property
    def held(self) -> int:
        return self.caches[0].held

    @property
    def evicted(self) -> int:
        return max(c.evicted for c in self.caches)

    @property
    def pre_rope(self) -> bool:
        return self.caches[0].pre_rope

    @property
    def next_position(self) -> int:
        return self.caches[0].next_position

    @property
    def choosing(self) -> bool:
        return any(c.choosing for c in self.caches)

    def layer(self, i: int) -> GroupView:
        return GroupView([c.layer(i) for c in self.caches])

    def splits(self) -> list[tuple[slice, KVCache]]:
        """(the batch rows, the cache) of each cache, in order."""
        out, start = [], 0
        for cache, n in zip(self.caches, self.rows):
            out.append((slice(start, start + n), cache))
            start += n
        return out

    def choose(self, k: torch.Tensor, v: torch.Tensor, probes=None, writer: Writer = REFERENCE) -> None:
        """Each choosing cache chooses from its rows of k, v (L, sum of batches, H, n, D) and of the
        probes' queries (a probe's weight is the whole batch's)."""
        from minillama.kv.auto import Probe

        for rows, cache in self.splits():
            if cache.choosing:
                mine = [Probe(p.queries[rows], p.weight) for p in probes] if probes else None
                cache.choose(k[:, rows], v[:, rows], mine, writer)

    def append(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]], writer: Writer = REFERENCE) -> None:
        """new_kv: per layer (k, v), each (sum of batches, H, T, D): each cache gets its rows."""
        for rows, cache in self.splits():
            cache.append([(k[rows], v[rows]) for k, v in new_kv], writer)
