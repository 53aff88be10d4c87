"""Several caches decoded as one batch: the rows of a ``CacheGroup`` are its caches' rows in turn.

An evaluation that compares KV schemes runs the same tokens through one cache per scheme.
Decoding them one after another reads every weight of the model once per scheme and step;
decoding them as rows of one batch reads each weight once per step for all of them (the
weights dominate a small model's step). Each cache keeps its own codecs, and attention reads
each cache alone (``model/attention.py: attend_cache`` splits a ``GroupView`` by rows), so a
row's result is what its cache alone would give, up to the float rounding of a larger batch.

The caches must be alike in everything the model sees of them as a whole: positions (same
held count, same position rules) and whether keys are stored before RoPE.
"""

from __future__ import annotations

import torch

from minillama.errors import UserError
from minillama.kv.cache import KVCache
from minillama.kv.interface import LayerView, PartView, Probe
from minillama.native.abi import NotSupported

ONE_AT_A_TIME = "a group of caches is attended one cache at a time (kv/group.py)"


class GroupView:
    """One layer of every cache of a group (kv/interface.py: LayerView, split by rows)."""

    def __init__(self, views: list[LayerView], rows: list[int]):
        self.views, self.rows = views, rows  # rows[i]: the batch rows of views[i]

    def splits(self) -> list[tuple[slice, LayerView]]:
        """(the batch rows, the view) of each cache, in order."""
        out, start = [], 0
        for view, n in zip(self.views, self.rows):
            out.append((slice(start, start + n), view))
            start += n
        return out

    # A group has no one codec or layout: whoever asks for them (the native step's plans) is told
    # to attend cache by cache, which attend_cache does.
    @property
    def k_codec(self):
        raise NotSupported(ONE_AT_A_TIME)

    v_codec = key_center = k_codec

    def parts(self) -> tuple[list[PartView], list[PartView]]:
        raise NotSupported(ONE_AT_A_TIME)


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
    def wants_queries(self) -> int:
        return max(c.wants_queries for c in self.caches)

    def layer(self, i: int) -> GroupView:
        return GroupView([c.layer(i) for c in self.caches], self.rows)

    def append(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]], probes: list[Probe] | None = None) -> None:
        """new_kv: per layer (k, v), each (sum of batches, H, T, D), and a Probe per layer when asked
        for: each cache gets its rows (a probe's weight is the whole batch's)."""
        start = 0
        for cache, n in zip(self.caches, self.rows):
            rows = slice(start, start + n)
            mine = [Probe(p.queries[rows], p.weight) for p in probes] if probes and cache.wants_queries else None
            cache.append([(k[rows], v[rows]) for k, v in new_kv], mine)
            start += n
