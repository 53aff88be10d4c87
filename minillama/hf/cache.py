"""A transformers cache whose layers keep their keys and values in minillama's stores.

transformers (v5) asks a cache one layer at a time: ``update(k, v)`` hands over the new keys
(after RoPE) and values of one decoder layer and gets back every key and value that layer's
attention should see (``transformers.cache_utils.CacheLayerMixin``). ``MinillamaLayer`` answers
as minillama's own attention reads (model/attention.py: attend_cache): the past as stored --
decoded, back in plain space (un-rotated, the key center added back) -- then the new tokens
exact; the new tokens are then written, so the next step reads them as stored. Each layer is a
one-layer ``KVCache`` made on the device of the first keys it receives, so a model spread over
several GPUs (accelerate's ``device_map="auto"``) keeps each layer's cache beside it, and its
bytes are counted as minillama counts them.

What does not carry over to a foreign model, refused in one line by ``minillama_cache``:
``rope=pre`` (transformers rotates keys before the cache sees them), ``bits=auto`` (chosen from
queries the cache never sees), a ring that evicts (transformers' masks assume every past token
is held: the cache stops when full instead), and sliding-window or non-attention layers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from minillama.errors import UserError
from minillama.kv.cache import KVCache
from minillama.kv.codecs import plain_keys
from minillama.kv.spec import KVSpec


class MinillamaLayer(CacheLayerMixin):
    """One decoder layer's keys and values in a minillama ``KVCache`` of up to `capacity` tokens."""

    is_sliding = False

    def __init__(self, spec: KVSpec, capacity: int):
        super().__init__()
        self.spec, self.capacity = spec, capacity
        self.cache: KVCache | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape  # (B, Hkv, T, D)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.cache = KVCache(self.spec, 1, h, d, self.capacity, batch=b, device=self.device, on_full="stop")
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """New k, v (B, Hkv, T, D) -> every key and value attention sees, (B, Hkv, held + T, D):
        the past as stored, then the new tokens exact."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        view = self.cache.layer(0)
        past_k, past_v = view.read(torch.float32)  # (B, Hkv, held, D) each, in storage space
        past_k = plain_keys(past_k, view.k_codec, view.key_center)
        past_v = view.v_codec.from_space(past_v)
        self.cache.append([(key_states, value_states)])
        keys = torch.cat([past_k.to(key_states.dtype), key_states], dim=-2)
        values = torch.cat([past_v.to(value_states.dtype), value_states], dim=-2)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.held if self.cache is not None else 0

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UserError("minillama's cache keeps no beams: generate with num_beams=1")


class MinillamaCache(Cache):
    """A ``transformers`` cache of ``MinillamaLayer``s, with minillama's byte counts over them."""

    def __init__(self, spec: KVSpec, n_layers: int, capacity: int):
        super().__init__(layers=[MinillamaLayer(spec, capacity) for _ in range(n_layers)])
        self.spec = spec

    def caches(self) -> list[KVCache]:
        return [layer.cache for layer in self.layers if layer.cache is not None]

    def live_bytes(self) -> int:
        """The bytes every layer's cache holds now: codes, scales, residual, sinks."""
        return sum(sum(c.live_bytes().values()) for c in self.caches())

    def bits_per_element(self) -> float:
        """Stored bits per key or value element, averaged over the layers (as ``KVCache``)."""
        caches = [c for c in self.caches() if c.held]
        return sum(c.bits_per_element() for c in caches) / len(caches) if caches else float("nan")


def attention_layers(config) -> int:
    """How many decoder layers of a transformers config hold plain full attention; a one-line
    refusal for sliding windows and layer kinds minillama's cache cannot stand in for."""
    text = getattr(config, "get_text_config", lambda: config)()
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise UserError(
            f"{text.model_type} has {', '.join(sorted(kinds - {'full_attention'}))} layers: minillama's cache "
            "stands in only for plain full attention"
        )
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        raise UserError(
            f"{text.model_type} attends in a sliding window of {text.sliding_window} tokens: minillama's cache "
            "stands in only for plain full attention"
        )
    return text.num_hidden_layers


def check_foreign(spec: KVSpec) -> None:
    """A one-line refusal of what a spec asks that a foreign model cannot give (module docstring)."""
    if spec.rope == "pre":
        raise UserError("rope=pre needs the model's own RoPE: transformers rotates keys before the cache sees them")
    if spec.auto:
        raise UserError("bits=auto chooses codecs from the model's queries, which a transformers cache never sees")
    if spec.layer_codecs:
        raise UserError("layers= maps are made for the default model: give one k= and v= for every layer")


def minillama_cache(config, spec: KVSpec, capacity: int) -> MinillamaCache:
    """A cache for a transformers model with this config, storing every layer as `spec` says, for up
    to `capacity` tokens (or the least the spec needs: a residual, a group); refuses what cannot
    apply to a foreign model (see the module docstring)."""
    check_foreign(spec)
    return MinillamaCache(spec, attention_layers(config), max(capacity, spec.min_capacity))
