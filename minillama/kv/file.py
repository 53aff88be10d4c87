"""The cache as a file: exactly the bytes the rings hold, in safetensors, checked before it is trusted.

A saved cache is a safetensors file (no pickle; memory-mappable; mlx-lm's prompt caches use
the same container) holding, for every layer and tensor (K, V), each ring's *held* rows in
age order -- packed codes, fp16 scales and zeros, the exact residual and sinks -- plus the
per-sequence parameters (key center, fitted ranges and grids), the token ids the cache was
filled with, the held tokens' positions and the logits of the last token fed. Nothing is
dequantized: the file is the cache's live bytes, those few extra tensors and a JSON header.

The header (safetensors metadata, key ``minillama``) carries the format version, the ``--kv``
spec spelled out, the model's identity (its config, a fingerprint of its weights and their
dtype: model/prompt_cache.py computes it), the ring state (position, evictions, rows per
ring, the slot each ring started at) and a SHA-256 of every tensor's bytes. ``read`` checks
all of it before anything is used; ``restore`` checks the file against the model and spec
asked for and rebuilds a ``KVCache`` whose rings hold the same rows (starting at slot 0).
Every problem is a ``CacheFileError``: one line saying what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from minillama.errors import UserError
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv
from minillama.kv.store import TIER

FORMAT = "minillama-kv-cache/1"


class CacheFileError(UserError):
    """A cache file that cannot be used: damaged, another format, another model or spec."""


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _header_digest(header: dict) -> str:
    """SHA-256 of the header's fields (all but this one), so a changed count or name is caught too."""
    fields = {k: v for k, v in header.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


# The header fields every reader relies on, with their JSON types.
_FIELDS = {
    "kv": str,
    "kv_name": str,
    "model": dict,
    "n_layers": int,
    "n_kv_heads": int,
    "head_dim": int,
    "batch": int,
    "capacity": int,
    "position": int,
    "held": int,
    "evicted": int,
    "stores": list,
    "checksums": dict,
}


def _rings(store) -> dict:
    """Every ring of a store by the name the file gives it (the tier's as ``tier:codes``, ...)."""
    tier = {TIER + name: ring for name, ring in store.tier.items()}
    return {"sinks": store.sinks, "residual": store.residual, **store.body, **tier}


def encode(
    cache: KVCache, tokens: list[int], identity: dict, logits: torch.Tensor | None = None, extra: dict | None = None
) -> bytes:
    """The file's bytes for `cache` (every token it was fed: `tokens`; the last one's `logits`);
    `extra` is JSON data kept beside (chat: the messages). Nothing is written yet: a caller can
    encode a prompt's cache now and write it only when its run completes (``write_atomic``)."""
    from safetensors.torch import save as serialize

    if len(tokens) != cache.position:
        raise ValueError(f"{len(tokens)} tokens given for a cache that was fed {cache.position}")
    tensors: dict[str, torch.Tensor] = {}
    stores = []
    for i, pair in enumerate(cache.layers):
        for tensor, store in zip("kv", pair):
            rings = {}
            for part, ring in _rings(store).items():
                if ring.count:
                    tensors[f"layers.{i}.{tensor}.{part}"] = ring.read().contiguous()  # (B, H, rows, width)
                rings[part] = {"rows": ring.count, "start": ring.start}
            params = {"center": store.center} if store.center is not None else {}  # per-sequence tensors
            for name, t in params.items():
                tensors[f"layers.{i}.{tensor}.{name}"] = t.contiguous()
            stores.append(
                {"layer": i, "tensor": tensor, "n_body": store.n_body, "rings": rings, "params": sorted(params)}
            )
    tensors["tokens"] = torch.tensor(tokens, dtype=torch.int64)  # (position,)
    tensors["positions"] = cache.layer(0).positions().to(torch.int64)  # (held,)
    if logits is not None:
        tensors["logits"] = logits.detach().float().reshape(-1).contiguous()  # (V,)
    tensors = {name: t.cpu() for name, t in tensors.items()}
    header = {
        "format": FORMAT,
        "kv": cache.spec.canonical(),
        "kv_name": str(cache.spec),
        "model": identity,
        "n_layers": cache.n_layers,
        "n_kv_heads": cache.n_kv_heads,
        "head_dim": cache.head_dim,
        "batch": cache.batch,
        "capacity": cache.capacity,
        "position": cache.position,
        "held": cache.held,
        "evicted": cache.evicted,
        "stores": stores,
        "extra": extra or {},
        "checksums": {name: _digest(t) for name, t in tensors.items()},
    }
    header["header_sha256"] = _header_digest(header)
    return serialize(tensors, metadata={"minillama": json.dumps(header)})


def write_atomic(path: str | Path, data: bytes) -> int:
    """Write `data` to `path` so that `path` always holds the old file or the new one, whole.

    The bytes go to a temporary file of this process's own (a unique name beside the target, so
    two writers never share one) and are renamed over the target; on any way out before the
    rename -- an OSError, Ctrl-C, SIGTERM (the CLI turns it into SystemExit) -- the temporary
    file is removed. Two processes writing one path: the last rename wins, and both succeed."""
    target = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:
        raise CacheFileError(f"cannot save to {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes 0600; a cache file is an ordinary file
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)  # leave nothing half-written behind, however we leave
        except OSError:
            pass
        if isinstance(e, OSError):
            raise CacheFileError(f"cannot save to {path}: {e.strerror or e}") from None
        raise
    return target.stat().st_size


def save(
    cache: KVCache,
    path: str | Path,
    tokens: list[int],
    identity: dict,
    logits: torch.Tensor | None = None,
    extra: dict | None = None,
) -> int:
    """Write `cache` to `path` (``encode`` + ``write_atomic``); returns the bytes written. Replaces
    only a missing file or a minillama cache file (``check_replaceable``)."""
    check_replaceable(path)
    return write_atomic(path, encode(cache, tokens, identity, logits, extra))


def check_replaceable(path: str | Path) -> bool:
    """May a cache be written to `path`? True when a file is there to be replaced, False when none
    is; a CacheFileError, before any work is done, for a path that must not be touched: anything
    that is not a minillama cache file (a prompt, a model's weights, notes), a directory, a folder
    that does not exist or cannot be written."""
    p = Path(path)
    try:
        if p.is_dir() or str(path).endswith(("/", os.sep)):
            raise CacheFileError(f"cannot save to {path}: it is a directory; name a file in it, e.g. {p / 'cache.kv'}")
        if not p.exists():
            if not p.parent.is_dir():
                raise CacheFileError(f"cannot save to {path}: the folder {p.parent} does not exist")
            if not os.access(p.parent, os.W_OK):
                raise CacheFileError(f"cannot save to {path}: the folder {p.parent} is not writable")
            return False
        if not p.is_file():
            raise CacheFileError(f"cannot save to {path}: it is not a regular file")
    except (OSError, ValueError) as e:  # ValueError: a path with a NUL byte
        raise CacheFileError(f"cannot save to {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        read_header(p)
    except CacheFileError:
        raise CacheFileError(
            f"{path} exists and is not a minillama cache file: refusing to overwrite it "
            "(name a new file, or delete this one yourself)"
        ) from None
    return True


def read_header(path: str | Path) -> dict:
    """Only the JSON header of a cache file (safetensors: an 8-byte length, then JSON), without
    reading or checking its tensors: enough to tell a minillama cache file from any other file
    (``check_replaceable``), never enough to trust what it says (``read`` checks it all).
    CacheFileError when it is not a minillama cache file."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100_000_000:
                raise ValueError("no safetensors header")
            header = json.loads(f.read(size))
        fields = json.loads(header["__metadata__"]["minillama"])
        if not isinstance(fields, dict):
            raise ValueError("not an object")
        return fields
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CacheFileError(f"{path} is not a minillama cache file") from None


@dataclass
class SavedCache:
    """A cache file read and checked for integrity (not yet against a model or spec)."""

    path: Path
    header: dict
    tensors: dict[str, torch.Tensor]
    file_bytes: int

    @property
    def tokens(self) -> list[int]:
        return self.tensors["tokens"].tolist()

    @property
    def logits(self) -> torch.Tensor | None:
        return self.tensors.get("logits")

    @property
    def extra(self) -> dict:
        return self.header.get("extra") or {}


def read(path: str | Path) -> SavedCache:
    """Read a cache file and check that it is whole: safetensors, this format, every checksum."""
    from safetensors import safe_open

    p = Path(path)
    if p.is_dir():
        raise CacheFileError(f"{path} is a directory, not a cache file")
    if p.exists() and not p.is_file():  # a device, a pipe: not something a cache was saved to
        raise CacheFileError(f"{path} is not a regular file, so not a cache file")
    try:
        size = p.stat().st_size
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except FileNotFoundError:
        raise CacheFileError(f"{path} does not exist") from None
    except PermissionError:
        raise CacheFileError(f"{path} cannot be read (permission denied)") from None
    except Exception as e:  # safetensors' own errors: truncated, not safetensors, bad header
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise CacheFileError(f"{path} is not a readable safetensors file ({reason})") from None
    try:
        header = json.loads(meta["minillama"])
        fmt = header["format"]
    except (KeyError, TypeError, ValueError):
        raise CacheFileError(f"{path} is a safetensors file but not a minillama cache (no minillama header)") from None
    if fmt != FORMAT:
        raise CacheFileError(f"{path} is a {fmt!r} file; this minillama reads {FORMAT!r}: save the cache again")
    if not isinstance(header, dict) or header.get("header_sha256") != _header_digest(header):
        raise CacheFileError(f"{path} is damaged: its header does not match its checksum")
    for key, kind in _FIELDS.items():
        if not isinstance(header.get(key), kind):
            raise CacheFileError(f"{path} is damaged: its header lacks {key!r}")
    checksums = header["checksums"]
    if set(checksums) != set(tensors):
        raise CacheFileError(f"{path} is damaged: its tensors do not match its header")
    for name, t in tensors.items():
        if _digest(t) != checksums[name]:
            raise CacheFileError(f"{path} is damaged: tensor {name} does not match its checksum")
    return SavedCache(p, header, tensors, size)


def restore(
    saved: SavedCache,
    identity: dict | None,
    spec_text: str | None = None,
    capacity: int | None = None,
    device="cpu",
    on_full: str = "evict",
) -> KVCache:
    """A KVCache holding exactly the saved rows, after checking the file against the model
    (`identity`; None skips it, for inspection) and the spec asked for (`spec_text`)."""
    h, where = saved.header, saved.path
    if identity is not None:
        made, name = h["model"], h["model"].get("name")
        if made.get("config") != identity.get("config"):
            raise CacheFileError(f"{where} was made with another model ({name!r}: its config differs from this one's)")
        if made.get("dtype") != identity.get("dtype"):  # before the fingerprint, which the dtype changes too
            dtype = str(made.get("dtype")).removeprefix("torch.")
            raise CacheFileError(
                f"{where} was made with {dtype} weights, this run uses "
                f"{str(identity.get('dtype')).removeprefix('torch.')} (pass --dtype {dtype} to use it)"
            )
        if made.get("fingerprint") != identity.get("fingerprint"):
            raise CacheFileError(f"{where} was made with another model ({name!r}: its weights differ from this one's)")
    try:
        saved_spec = parse_kv(h["kv"])  # with bits=auto, the layers its cache chose
    except UserError as e:
        raise CacheFileError(f"{where} has a spec this version cannot read ({e})") from None
    if spec_text is not None and parse_kv(spec_text).canonical() != saved_spec.asked().canonical():
        raise CacheFileError(f"{where} holds a --kv {h['kv_name']} cache, not {spec_text}")
    try:
        spec = parse_kv(h["kv_name"])  # as the user named it (a preset keeps its name)
        if spec.auto:  # the codecs its cache chose from the saved sequence's prefill
            spec = replace(spec, layer_codecs=saved_spec.layer_codecs)
        if spec.canonical() != h["kv"]:
            raise CacheFileError(f"{where} is inconsistent: its spec {h['kv_name']!r} is not {h['kv']!r}")
        cache = KVCache(
            spec,
            h["n_layers"],
            h["n_kv_heads"],
            h["head_dim"],
            max(capacity or 0, h["capacity"]),
            h["batch"],
            device,
            on_full,
        )
        _fill(cache, saved)
    except CacheFileError:
        raise
    except UserError as e:  # a spec or capacity the cache itself refuses
        raise CacheFileError(f"{where}: {e}") from None
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as e:
        raise CacheFileError(
            f"{where} has an inconsistent header or tensors ({type(e).__name__}: {str(e)[:100]})"
        ) from None
    return cache


def _fill(cache: KVCache, saved: SavedCache) -> None:
    """Push the saved rows into the fresh cache's rings, checking every shape, dtype and count."""
    h, t = saved.header, saved.tensors
    bad = lambda what: CacheFileError(f"{saved.path} is inconsistent: {what}")  # noqa: E731
    position, held, evicted = int(h["position"]), int(h["held"]), int(h["evicted"])
    if not (0 <= held <= position and evicted >= 0 and held + evicted == position):
        raise bad(f"held {held}, evicted {evicted} and position {position} do not add up")
    if t["tokens"].shape != (position,) or t["positions"].shape != (held,):
        raise bad("the token ids or positions do not match the position and held counts")
    stores = {(s["layer"], s["tensor"]): s for s in h["stores"]}
    if set(stores) != {(i, x) for i in range(cache.n_layers) for x in "kv"}:
        raise bad("the header does not describe every layer's keys and values")
    # The layers that share a codec share their rings' cursors (kv/layered.py): each restores
    # its own rows, and all must hold as many as the first.
    group = {(i, "kv"[t]): shared for shared, t in zip(cache.stores, cache.tensor_of) for i in shared.layers}
    group_rows: dict = {}  # a group (LayeredStore) -> the rows of its first layer, by ring
    for i, pair in enumerate(cache.layers):
        for tensor, store in zip("kv", pair):
            entry, prefix = stores[(i, tensor)], f"layers.{i}.{tensor}."
            rings = _rings(store)
            held_rows = {part: int(entry["rings"].get(part, {}).get("rows", 0)) for part in rings}
            shared = group[(i, tensor)]
            if group_rows.setdefault(shared, held_rows) != held_rows:
                raise bad(f"layers {shared.layers} share a codec but hold different rows in their rings")
            for part, ring in rings.items():
                rows = held_rows[part]
                if not 0 <= rows <= ring.slots:
                    raise bad(f"{prefix}{part} holds {rows} rows, more than its ring's {ring.slots}")
                if rows:
                    x = t.get(prefix + part)
                    want = (cache.batch, cache.n_kv_heads, rows, ring.buf.shape[-1])
                    if x is None or tuple(x.shape) != want or x.dtype != ring.buf.dtype:
                        raise bad(f"{prefix}{part} is not a {ring.buf.dtype} tensor of shape {want}")
                    ring.restore(x.to(ring.buf.device))
            per_row = {name: store.tokens_per_row[name] for name in store.body}
            if any(store.body[name].count * n != int(entry["n_body"]) for name, n in per_row.items()):
                raise bad(f"{prefix}body rows do not cover its {int(entry['n_body'])} tokens")
            if len({ring.count for ring in store.tier.values()}) > 1:
                raise bad(f"{prefix}tier parts hold different numbers of tokens")
            if store.held != held:
                raise bad(f"{prefix}rings hold {store.held} tokens, the header says {held}")
            names = set(entry["params"])
            shape = (cache.batch, cache.n_kv_heads, 1, cache.head_dim)
            for name in names:
                x = t.get(prefix + name)
                if name != "center" or x is None or tuple(x.shape) != shape or x.dtype != torch.float16:
                    raise bad(f"{prefix}{name} is not a key center: a float16 tensor of shape {shape}")
            store.center = t[prefix + "center"].to(store.residual.buf.device) if "center" in names else None
            if (store.center is not None) != (store.centered and position > 0):
                raise bad(f"{prefix}center does not match the spec's center setting")
    cache.position, cache.evicted = position, evicted
