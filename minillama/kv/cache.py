"""The KV cache: a fixed-capacity ring buffer of (possibly quantized) keys and values.

Per layer and per tensor (K or V) a ``TensorStore`` (``store.py``) holds
``[ sinks | quantized body | tier | full-precision residual ]`` (a tier only with ``tier=``).
Only KV heads are stored (GQA expands after the read). By default keys are stored after RoPE, so each keeps the position
it was written at and positions keep increasing when the ring evicts; with ``rope=pre``
keys are stored before RoPE and the cache says which position each held token has
(``part_positions``): its original one, or with ``positions=cache`` its slot.

The model sees the cache only through the ``Cache`` protocol (kv/interface.py): it reads
each layer through ``layer(i)`` during a forward pass and hands all new K/V to ``append`` at
the end: that one call is the only place the cache grows or evicts. Every byte read and
written goes through ``Ring``s and is counted when it is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillama.errors import UserError
from minillama.kv.layered import LayeredStore
from minillama.kv.memory import check_fits
from minillama.kv.quantize import check_finite
from minillama.kv.spec import KVSpec
from minillama.kv.store import TensorStore, allocation_bytes
from minillama.kv.write import REFERENCE, Writer


class ContextFullError(UserError):
    """Raised with on_full="stop" when an append would exceed the cache capacity."""


@dataclass
class ByteCounters:
    last_read: int = 0
    last_written: int = 0
    total_read: int = 0
    total_written: int = 0


class KVCache:
    """Keys and values for every layer of B equal-length sequences, in a fixed-capacity ring.

    ``position`` is the absolute position of the next token (RoPE uses it); ``held`` is how
    many tokens are stored now; ``evicted`` counts tokens dropped by the ring.
    """

    def __init__(
        self,
        spec: KVSpec,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        batch: int = 1,
        device: torch.device | str = "cpu",
        on_full: str = "evict",
    ):
        spec = spec.fitted(head_dim)
        spec.validate(head_dim, n_layers)
        if capacity < spec.min_capacity:
            tier = f" + tier={spec.tier}" if spec.tier else ""
            raise UserError(
                f"cache capacity {capacity} is too small for sinks={spec.sinks} + residual={spec.residual}{tier} "
                f"+ one group of {spec.unit}: raise --ctx"
            )
        if on_full not in ("evict", "stop"):
            raise UserError(f"on_full must be 'evict' or 'stop', not {on_full!r}")
        if spec.start and spec.start > capacity - spec.sinks:
            raise UserError(
                f"--kv start={spec.start} must leave room in a cache of {capacity} tokens: lower start or raise --ctx"
            )
        per_head = sum(
            allocation_bytes(codec, group, spec, capacity, head_dim)
            for layer in range(n_layers)
            for codec, group, _ in spec.tensors(layer)
        )
        check_fits(batch * n_kv_heads * per_head, f"a {spec} cache of {capacity:,} tokens", device)
        self.capacity, self.batch, self.on_full = capacity, batch, on_full
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.device = device
        self._build(spec)
        self.position = 0
        self.evicted = 0
        self.bytes = ByteCounters()
        self._step_read = 0  # bytes read since the last append (the step in progress)

    def _build(self, spec: KVSpec) -> None:
        """Empty stores for `spec`: made once, and again where an auto spec chooses or is reset."""
        self.spec = spec
        self.unit = spec.unit  # tokens evicted together (whole per-channel groups)
        n_layers, batch, n_kv_heads, head_dim = self.n_layers, self.batch, self.n_kv_heads, self.head_dim
        # Keys, then values: the layers that share a codec keep their rings in shared buffers and
        # are written together (kv/layered.py); self.layers[i] is layer i's (K, V) stores.
        self.stores: list[LayeredStore] = []
        self.tensor_of: list[int] = []  # 0 (K) or 1 (V) for each of self.stores
        layers: list[list[TensorStore]] = [[] for _ in range(n_layers)]
        for t in (0, 1):
            kinds = [spec.tensors(layer)[t] for layer in range(n_layers)]  # (codec, group, centered) per layer
            for kind in dict.fromkeys(kinds):
                members = [i for i, k in enumerate(kinds) if k == kind]
                shared = LayeredStore(
                    members, *kind[:2], spec, self.capacity, batch, n_kv_heads, head_dim, self.device, kind[2]
                )
                self.stores.append(shared)
                self.tensor_of.append(t)
                for i, store in zip(members, shared.stores):
                    layers[i].append(store)
        self.layers = [tuple(pair) for pair in layers]
        # What a full read touches, counted per step without walking the stores: every shared
        # ring's cursor with the bytes of one row across its layers, and the groups whose keys
        # are centered (the center is read too).
        self._rows_read = [
            (ring.lead.cursor, ring.lead.row_bytes * len(ring.members))
            for shared in self.stores
            for ring in (shared.sinks, *shared.body.values(), *shared.tier.values(), shared.residual)
        ]
        self._with_params = [s for s in self.stores if s.stores[0].centered]

    @property
    def choosing(self) -> bool:
        """An auto spec (``bits=auto``, kv/auto.py) whose codecs are not chosen yet: the first append
        chooses them, or ``choose`` before it, from the queries of the prompt (model/auto.py)."""
        return self.spec.auto and not self.spec.layer_codecs

    def choose(self, k: torch.Tensor, v: torch.Tensor, probes=None, writer: Writer = REFERENCE) -> None:
        """An auto spec's codecs for every layer, chosen from the first tokens' keys and values, each
        (L, B, H_kv, n, D), and the layers' newest queries and error weights (kv/auto.py: Probe;
        without them each tensor is priced by its own reconstruction error)."""
        from minillama.kv.auto import choose  # the auto machinery loads only for an auto spec

        check_finite(k)
        check_finite(v)
        self._build(choose(self.spec, k, v, probes, writer))

    @classmethod
    def for_model(
        cls, cfg, spec: KVSpec, capacity: int | None = None, batch: int = 1, device="cpu", on_full="evict"
    ) -> KVCache:
        return cls(
            spec,
            cfg.num_hidden_layers,
            cfg.n_kv_heads,
            cfg.head_dim,
            capacity or cfg.max_position_embeddings,
            batch,
            device,
            on_full,
        )

    @property
    def held(self) -> int:
        return self.layers[0][0].held

    # -- positions ----------------------------------------------------------------------

    @property
    def pre_rope(self) -> bool:
        """Keys are stored before RoPE (rope=pre) and rotated for their positions when read."""
        return self.spec.rope == "pre"

    @property
    def next_position(self) -> int:
        """Position of the next token (the following ones count on from it): absolute, or with
        positions=cache the slot it will take after the held tokens (StreamingLLM's rule)."""
        return self.held if self.spec.positions == "cache" else self.position

    def first_rest_position(self) -> int:
        """Position of the oldest held token that is not a sink (positions are consecutive from it):
        absolute, or with positions=cache its slot (sinks take the first ones)."""
        sinks = self.layers[0][0].sinks.count
        return sinks if self.spec.positions == "cache" else self.position - (self.held - sinks)

    def layer(self, i: int) -> CacheLayer:
        """What attention reads of layer i (kv/interface.py: LayerView)."""
        return CacheLayer(self, i)

    def count_full_read(self) -> None:
        """Every held part of every layer was read in place (the compiled decode step reads them so):
        count it, as every store's ``live_read_bytes`` would (tests/test_cache.py holds them equal)."""
        rows = sum(cursor.count * row_bytes for cursor, row_bytes in self._rows_read)
        self.count_read(rows + sum(s.stores[0].center_bytes * len(s.stores) for s in self._with_params))

    def count_read(self, nbytes: int) -> None:
        """Count bytes read from the cache now (``last_read`` reports the step once it is appended)."""
        self.bytes.total_read += nbytes
        self._step_read += nbytes

    def append(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]], writer: Writer = REFERENCE) -> None:
        """Write one step's keys and values, each (B, H_kv, n, D) per layer; evict if full. An auto
        spec's cache first chooses every layer's codecs from them (``choose``)."""
        k, v = torch.stack([k for k, _ in new_kv]), torch.stack([v for _, v in new_kv])  # (L, B, H_kv, n, D)
        if self.choosing:
            self.choose(k, v, None, writer)
        self.append_stacked(k, v, writer)

    def append_stacked(self, k: torch.Tensor, v: torch.Tensor, writer: Writer = REFERENCE) -> None:
        """``append`` with every layer's keys and values stacked, each (L, B, H_kv, n, D), converted
        and coded by `writer` (kv/write.py). Nothing keeps k or v: the caller may reuse them."""
        n = k.shape[3]
        overflow = self.held + n - self.capacity
        if overflow > 0 and self.on_full == "stop":
            raise ContextFullError(
                f"context full: {self.held} + {n} tokens > capacity {self.capacity} (raise --ctx or use --on-full evict)"
            )
        unit = self.unit
        evict = -(-overflow // unit) * unit if overflow > 0 else 0
        if self.spec.quantized:  # refused before any group is written, not after the keys are
            check_finite(k)
            check_finite(v)
        done = (0, 0)
        for shared, t in zip(self.stores, self.tensor_of):  # every layer that shares a codec at once
            w, r = shared.append(self._members(shared, v if t else k), evict, writer)
            done = (done[0] + w, done[1] + r)
        self.count_append(n, evict, *done)

    def count_append(self, n: int, evict: int, written: int, read: int) -> None:
        """n tokens were appended (evict evicted first), by ``append_stacked`` or by a writer that
        moved the stores itself (native/token_write.py): move the position, count the bytes."""
        self.position += n
        self.evicted += evict
        self.count_read(read)
        self.bytes.last_read, self.bytes.last_written = self._step_read, written
        self.bytes.total_written += written
        self._step_read = 0

    def _members(self, shared: LayeredStore, x: torch.Tensor) -> torch.Tensor:
        """The rows of x (L, B, H, n, D) that a group's layers store."""
        return x if len(shared.layers) == self.n_layers else x.index_select(0, shared.layer_index)

    def seek(self, position: int) -> None:
        """Leave a gap: the next token gets this absolute position (used to rebuild a ring)."""
        if position < self.position:
            raise ValueError("seek can only move forward")
        self.position = position

    def truncate(self, n: int) -> int:
        """Forget every token at position >= n; returns how many leading tokens are kept.

        Fewer than n are kept when n cuts a quantized per-channel group (the caller
        re-prefills from the returned position) and 0 when the tokens before n were
        partly evicted already (the caller re-prefills everything).
        """
        if n >= self.position:
            return self.position
        sinks = self.layers[0][0].sinks.count
        oldest = self.position - (self.held - sinks)  # position of the oldest held non-sink token
        if n < oldest or (self.evicted and n < sinks) or n <= sinks:
            self.reset()
            return 0
        m = min(store.keep_newest_limit(n - oldest) for pair in self.layers for store in pair)
        for shared in self.stores:
            shared.truncate_nonsink(m)
        self.position = oldest + m
        return self.position

    def reset(self) -> None:
        if self.spec.auto and self.spec.layer_codecs:  # a new sequence: an auto spec chooses again
            self._build(self.spec.asked())
        for shared in self.stores:
            shared.clear()
        self.position = self.evicted = 0

    # -- accounting -------------------------------------------------------------------

    def live_bytes(self) -> dict[str, int]:
        """Bytes held for the current tokens, by component (codes, scales, residual, sinks)."""
        total = {"codes": 0, "scales": 0, "residual": 0, "sinks": 0}
        for pair in self.layers:
            for store in pair:
                for key, value in store.live_bytes().items():
                    total[key] += value
        return total

    def allocated_bytes(self) -> int:
        return sum(store.allocated_bytes() for pair in self.layers for store in pair)

    def bits_per_element(self) -> float:
        """8 x live bytes / (layers x 2 x kv_heads x head_dim x tokens held x batch)."""
        elements = self.n_layers * 2 * self.n_kv_heads * self.head_dim * self.held * self.batch
        return 8 * sum(self.live_bytes().values()) / elements if elements else float("nan")


class CacheLayer:
    """One layer of a ``KVCache`` as attention reads it (kv/interface.py: LayerView)."""

    def __init__(self, cache: KVCache, i: int):
        self.cache = cache
        self.keys, self.values = cache.layers[i]  # the layer's two TensorStores
        self.k_codec, self.v_codec = self.keys.codec, self.values.codec
        self.key_center = self.keys.center  # (B, H, 1, D) or None

    def positions(self, device=None) -> torch.Tensor:
        """Positions of the held tokens in age order (held,), as a read returns them."""
        ranges = [
            torch.arange(p.first_position, p.first_position + p.n)
            for p in self.keys.parts(self.cache.first_rest_position())
        ]
        return (torch.cat(ranges) if ranges else torch.zeros(0, dtype=torch.long)).to(device)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Held keys and values, each (B, H_kv, held, D), dequantized, in storage space."""
        k, nk = self.keys.read(dtype)
        v, nv = self.values.read(dtype)
        self.cache.count_read(nk + nv)
        return k, v
