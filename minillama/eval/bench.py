"""Decode-speed benchmark: tokens/s, bytes read per token, and the share of memory bandwidth.

For each KV scheme and context length: fill the cache to N tokens (a real prefill of an
evaluation text, Hamlet by default, or ``synthetic`` K/V written straight into the cache: unit
Gaussians with a few large key channels, the shape of real Llama keys), then time T
decode steps after a warm-up and report the median. ``roofline_pct`` compares bytes
read per token (weights + cache, from the cache's own counters) over the step time
with a read bandwidth measured at start. ``peak_rss_mb`` is the process's peak
resident memory during that row (the kernel's high-water mark, reset per row).
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from minillama.eval.pyplot import pyplot
from minillama.eval.synthetic import fill_synthetic
from minillama.kv.cache import KVCache
from minillama.kv.memory import huge_page_zeros
from minillama.kv.spec import KVSpec
from minillama.model.attention import attend_cache
from minillama.model.generate import decode_step, prefill
from minillama.model.loader import LoadedModel
from minillama.native import backend, ops
from minillama.native.abi import NotSupported
from minillama.native.plans import decode_plan
from minillama.native.step import int8_products
from minillama.native.weights import fused_rows
from minillama.native.write import writer

WARMUP = 3
# Decode steps whose 10th and 90th percentile times lie further apart than this share of their
# median were measured on a busy machine (alone, the spread is a few per cent): the table says so.
NOISY_SPREAD_PCT = 25.0

COLUMNS = """columns:
  ms/tok, tok/s   a decode step's median time over the timed steps, and its inverse
  spread          (90th - 10th percentile step time) / median: above 25% the machine was busy
  attn ms/layer   one layer's decode attention alone (median, the layers in turn)
  attn GB/s       the cache bytes one layer's attention reads / attn ms/layer
  prefill/s       prompt tokens per second filling the cache (fill=prefill only)
  cache MB        the bytes the cache holds at that context
  read MB/tok     the bytes a step reads: weights plus the cache (the cache's own counters)
  roofline        read MB/tok over the step time, as a share of the measured read bandwidth
  peak RSS        the process's peak resident memory during the row
  proj ms         every projection of one step alone (all layers' matrices and the LM head)"""


@dataclass
class BenchRow:
    kv: str
    context: int
    decode_ms_per_token: float
    decode_tokens_per_s: float
    spread_pct: float  # (p90 - p10) / median of the timed steps, in per cent
    attention_ms_per_layer: float  # one layer's decode attention kernel alone (median, every layer in turn)
    attention_gb_s: float  # the cache bytes one layer's attention reads / attention_ms_per_layer
    projection_ms: float  # every projection of one step alone (median): all layers' matrices and the LM head
    prefill_tokens_per_s: float | None
    cache_bytes: int
    bytes_read_per_token: int
    roofline_pct: float
    peak_rss_mb: float
    model: str
    dtype: str  # the activations' (and float weights') dtype
    weights: str  # how the matrices are stored: the dtype, or block kinds (minillama/weights), e.g. "q4_1/q8_0"
    fill: str
    backend: str  # native/backend.py: describe(), e.g. "kernels (native build: avx2 ...; integer attention)"
    fallbacks: list[str]  # why any fast path took the reference during this row (empty: none did)

    def to_dict(self) -> dict:
        return asdict(self)


def return_freed_memory_to_the_os() -> None:
    """Allocations of 1 MiB and more go to mmap (a fixed threshold), so a freed cache's
    buffers return to the OS and each row's peak RSS is its own; per-step temporaries
    stay below the threshold and keep coming from the heap (no mmap churn)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux)
    except OSError:
        pass


def peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_bandwidth(mb: int = 512, repeats: int = 7) -> float:
    """Memory read bandwidth in bytes/s: what the kernels' threads (``backend.threads()``: --threads,
    else every core) stream, summing a float32 tensor in huge pages as the step's weights are --
    the fastest of `repeats` reads, since the floor it sets is the least time a token's bytes can
    take. The count is set for the probe: a decode step's chooser may have left OpenMP on fewer."""
    x = huge_page_zeros((mb * 2**20 // 4,), torch.float32, "cpu").fill_(1.0)  # (mb MiB / 4,)
    threads = torch.get_num_threads()
    torch.set_num_threads(backend.threads())
    try:
        x.sum()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return x.numel() * 4 / min(times)


def weight_kinds(model) -> str:
    """How the model's matrices are stored: "bfloat16", or its block kinds, "q4_1/q8_0"."""
    matrices = [m for m in model.modules() if hasattr(m, "in_features") or hasattr(m, "embedding_dim")]
    return "/".join(sorted({getattr(m, "kind", None) or str(model.dtype).removeprefix("torch.") for m in matrices}))


def weight_bytes_per_token(model) -> int:
    """Weight bytes one decode step reads: every matrix once; from the embedding only one
    row, unless the LM head is tied to it (then the whole table, once)."""
    unique = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in unique.values())
    emb = model.model.embed_tokens.weight
    if model.lm_head.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    return total


def bench_row(
    lm: LoadedModel,
    spec: KVSpec,
    context: int,
    decode_tokens: int,
    fill: str,
    ids: list[int],
    bandwidth: float,
    dtype: str,
) -> BenchRow:
    reset_peak_rss()
    seen = len(backend.fallbacks())
    capacity = max(context + decode_tokens + WARMUP + 1, spec.min_capacity)  # never evicts
    cache = KVCache.for_model(lm.config, spec, capacity)
    prefill_tps = None
    if fill == "prefill":
        t0 = time.perf_counter()
        logits = prefill(lm.model, ids[:context], cache)[0]
        prefill_tps = context / (time.perf_counter() - t0)
    else:
        fill_synthetic(cache, context, writer=writer())
        logits = decode_step(lm.model, ids[0], cache)
    token = int(logits.argmax())
    times = []
    for i in range(WARMUP + decode_tokens):
        t0 = time.perf_counter()
        logits = decode_step(lm.model, token, cache)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
        token = int(logits.argmax())
    step_s = statistics.median(times)
    deciles = statistics.quantiles(times, n=10) if len(times) > 1 else [step_s] * 9
    read = weight_bytes_per_token(lm.model) + cache.bytes.last_read
    attention, projections = attention_ms(lm, cache), projection_ms(lm.model)
    layer_bytes = cache.bytes.last_read / lm.config.num_hidden_layers  # what one layer's attention read last step
    return BenchRow(
        kv=str(spec),
        context=context,
        decode_ms_per_token=1000 * step_s,
        decode_tokens_per_s=1 / step_s,
        spread_pct=100 * (deciles[-1] - deciles[0]) / step_s,
        attention_ms_per_layer=attention,
        attention_gb_s=layer_bytes / attention / 1e6,
        projection_ms=projections,
        prefill_tokens_per_s=prefill_tps,
        cache_bytes=sum(cache.live_bytes().values()),
        bytes_read_per_token=read,
        roofline_pct=100 * read / step_s / bandwidth,
        peak_rss_mb=peak_rss_mb(),
        model=lm.name,
        dtype=dtype,
        weights=weight_kinds(lm.model),
        fill=fill,
        backend=backend.describe(),
        fallbacks=backend.fallbacks()[seen:],
    )


@torch.inference_mode()
def attention_ms(lm: LoadedModel, cache: KVCache, repeats: int = 10) -> float:
    """Median ms of one layer's decode attention over this cache (random q, k, v of the model's
    shapes). With the kernels backend: the attention kernel the step calls, its plans built once
    and the layers taken in turn, so each reads its cache from memory as a decode step does
    (one layer again and again would sit in L3); else the reference ``attend_cache`` of layer 0."""
    cfg = lm.config
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, cfg.num_attention_heads, 1, cfg.head_dim, generator=g).to(lm.model.dtype)
    k, v = (torch.randn(1, cfg.n_kv_heads, 1, cfg.head_dim, generator=g).to(lm.model.dtype) for _ in range(2))
    rotary = lm.model.rotary if cache.pre_rope else None
    lib = backend.library()
    if lib is None:
        return median_ms(lambda: attend_cache(q, k, v, cache.layer(0), rotary), repeats)
    keep: list = []
    out = torch.empty_like(q)  # (1, Hq, 1, D)
    try:
        rope = rotary.halves if rotary is not None else None
        plans = [decode_plan(lib, q, k, v, out, cache.layer(i), rope, keep) for i in range(cfg.num_hidden_layers)]
    except NotSupported:  # a part no kernel reads: the step takes the reference, so does this
        return median_ms(lambda: attend_cache(q, k, v, cache.layer(0), rotary), repeats)
    return median_ms(lambda: [ops.attend_layer(lib, plan) for plan in plans], repeats) / len(plans)


def _products(*layers) -> list[tuple[torch.Tensor, str | None, int]]:
    """The products the native step takes for projections of one input: one over their fused rows
    when stored alike, else one a projection (native/step.py: group_rows)."""
    if len({getattr(m, "kind", None) for m in layers}) == 1:
        return [_fused(*layers)]
    return [_fused(m) for m in layers]


def _fused(*layers) -> tuple[torch.Tensor, str | None, int]:
    """The weights of projections of one input as the native step multiplies them: one matrix,
    its block kind (minillama/weights; None for float weights) and its input size."""
    kind, n_in = getattr(layers[0], "kind", None), layers[0].in_features
    try:
        return fused_rows(list(layers))[0], kind, n_in  # (sum out, ...): side by side (native/weights.py)
    except NotSupported:
        return torch.cat([m.weight for m in layers]), kind, n_in  # (sum out, ...)


@torch.inference_mode()
def projection_ms(model, repeats: int = 10) -> float:
    """Median ms of one step's projections alone: every layer's fused q/k/v, o, fused gate/up and
    down, then the LM head, in that order, on one row (the kernel a decode step calls when the
    backend has one, else the layers' own forward). With ``attention_ms`` this splits a step."""
    lib = backend.library()
    mats = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        mats += _products(a.q_proj, a.k_proj, a.v_proj) + _products(a.o_proj)
        mats += _products(m.gate_proj, m.up_proj) + _products(m.down_proj)
    mats.append(_fused(model.lm_head))
    xs = {n: torch.randn(1, n).to(model.dtype) for _, _, n in mats}  # (1, in) per input size
    layers = [m for m in model.modules() if hasattr(m, "in_features")]  # the reference's own products
    int8 = int8_products(model)

    def one_pass():
        if lib is None:
            for layer in layers:
                layer(xs[layer.in_features])
        else:
            for w, kind, n in mats:
                ops.gemm_rows(lib, xs[n], w, kind, kind is not None and int8)

    return median_ms(one_pass, repeats, warmup=2)


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median wall milliseconds of `repeats` calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def format_table(rows: list[BenchRow], bandwidth: float) -> str:
    from minillama.eval.perplexity import aligned

    head = (
        f"decode benchmark: {rows[0].model}, weights {rows[0].weights}, activations {rows[0].dtype}, fill {rows[0].fill}; "
        f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s; backend {rows[0].backend}"
    )
    table = [["kv", "context", "ms/tok", "tok/s", "spread", "attn ms/layer", "attn GB/s", "prefill/s", "cache MB"]]
    table[0] += ["read MB/tok", "roofline", "peak RSS", "proj ms"]
    for r in rows:
        table.append(
            [
                r.kv,
                str(r.context),
                f"{r.decode_ms_per_token:.2f}",
                f"{r.decode_tokens_per_s:.1f}",
                f"{r.spread_pct:.0f}%",
                f"{r.attention_ms_per_layer:.3f}",
                f"{r.attention_gb_s:.1f}",
                f"{r.prefill_tokens_per_s:.0f}" if r.prefill_tokens_per_s else "-",
                f"{r.cache_bytes / 1e6:.1f}",
                f"{r.bytes_read_per_token / 1e6:.1f}",
                f"{r.roofline_pct:.0f}%",
                f"{r.peak_rss_mb:.0f}M",
                f"{r.projection_ms:.2f}",
            ]
        )
    lines = [head, *aligned(table)]
    lines += [f"  {r.kv} at {r.context}: {reason}" for r in rows for reason in r.fallbacks]
    noisy = [r for r in rows if r.spread_pct > NOISY_SPREAD_PCT]
    if noisy:
        worst = max(r.spread_pct for r in noisy)
        lines.append(
            f"warning: the decode steps of {len(noisy)} row(s) varied by up to {worst:.0f}% of their median "
            f"(more than {NOISY_SPREAD_PCT:.0f}%): another process was using the CPU; these numbers are not "
            "the machine's -- rerun alone"
        )
    return "\n".join([*lines, COLUMNS])


def plot(rows: list[BenchRow], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kv in dict.fromkeys(r.kv for r in rows):
        pts = sorted((r.context, r.decode_ms_per_token) for r in rows if r.kv == kv)
        ax.plot(*zip(*pts), marker="o", label=kv)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms / token")
    ax.set_title(f"minillama decode latency, {rows[0].model} ({rows[0].dtype} weights)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
