"""Key bits spent by RoPE frequency block (the ``lm{b}f{nb}`` codecs), measured on the cached path.

    python bench/freq_blocks_ppl.py 4                        # evaluate on Hamlet, W 4 (N 896, P 128)
    python bench/freq_blocks_ppl.py --text FILE 4            # any UTF-8 text, W 4
    python bench/freq_blocks_ppl.py --choose FILE 1          # the bits chosen on another text
    python bench/freq_blocks_ppl.py --bits 2 --text FILE 4   # keys at 2 bits (2, 3 or 4; default 3)
    python bench/freq_blocks_ppl.py --mix --text FILE 4      # on top of the per-layer mix k3v2mixb
    python bench/freq_blocks_ppl.py --frontier 3.0 --text FILE 4  # block keys and values at 3.0 bits
    python bench/freq_blocks_ppl.py --frontier 2.81 --vq --split 4   # and each joint row's K and V alone
    python bench/freq_blocks_ppl.py --equal --text FILE 4    # blocks at equal bits: rotation and scales alone
    python bench/freq_blocks_ppl.py --by-keys --text FILE 4  # bits chosen without the queries
    python bench/freq_blocks_ppl.py --table 2 0              # print the 2-block keys' spec for minillama ppl
    python bench/freq_blocks_ppl.py --frontier 2.73 --vq --tier 56:lm4hb 4   # every row with an age tier
    python bench/freq_blocks_ppl.py --frontier 2.185 --tier 56:lm4hb --specs 1  # the rows' --kv specs

Issue 28, item 2 ("each KV head's or frequency block's" bits; KVTuner, Block-GTQ). A Hadamard
rotation over the whole head spreads a key's quantization error evenly over its 64 channels,
but a score's error is sum_c q_c e_c: where queries and keys put their energy decides where the
error costs. RoPE pairs channel f with f + 32 at one frequency; a *block* here is the channels
of 32 / nb consecutive frequencies (both halves of each pair), so a block keeps RoPE's pairs
whole. With Q_b and K_b a block's summed mean squares (queries over the R heads that share the
KV head, keys centered on their first 128 tokens) and n its channels, the expected squared
score error of a block rotated and quantized on its own at b bits is Q_b K_b / n * eps(b)
(eps: the Gaussian Lloyd-Max error per unit variance), against (sum Q)(sum K) / 64 * eps for the
whole-head rotation. Each KV head of each layer gets the bits per block that minimize the sum
under the budget (nb * b bits: a row keeps b bits an element on average), taken greedily one bit
at a time (optimal: eps is convex). The bits are chosen once from a text (``--choose``, default
Hamlet's first 896 tokens, fp32, no cache) and then fixed: a per-model table, as the mixes' layer
codecs are, never fitted to the evaluated text unless it is the choice text.

Each layer's table becomes the codec ``lm{b}f{nb}:{widths}`` (kv/freq_blocks.py):
each block Hadamard-rotated on its own (size 64 / nb), Lloyd-Max codes of its bits, one one-byte
log scale per block (a block of 0 bits is dropped); b + 8 nb / 64 bits an element. No kernel
reads it yet, so every row of these runs takes the PyTorch path. (Runs before the codec existed
used a stand-in that kept the same decoded rows as float32; bench/results names which.) Rows
printed, keys only (values fp16; centered keys, group 64, residual 8, 4 sinks): fp16, lm{b}h,
lm{b}hb, the 2- and 4-block codecs at b bits (``--bits``, default 3), and lm{b+1}hb for the
price of a bit. ``--table NB`` prints the keys-only spec with the chosen tables instead.

With ``--mix``: fp16, ``k3v2mixb`` (2.81 body bits an element), its layers' codecs with every
key codec lm{b}hb replaced by the 2-block codec at b bits (the blocks' scales on top), and
for 2 and 4 blocks ``kv allocate`` over the four Hamlet maps the preset was made from (byte
scales) at a budget lowered by what the blocks' extra scales cost, (nb - 1) / 16 bits an element
of K and V, every key codec then replaced the same way: the preset's body bits, spent on blocks
instead of on layers.

With ``--frontier BITS``: fp16, ``kv allocate`` over the same maps at BITS (byte scales: the
per-layer answer at that budget); every layer's keys the 2-block codec at floor(BITS) bits
(3.25 bits an element at 3) with the values' codecs chosen from the maps' V rows alone (lm2hb, lm3hb or lm4hb a layer) so
that K and V average BITS; and for 2 and 4 blocks the joint answer: ``kv allocate`` at BITS
with every key choice of the maps offered also as the block codec of its code bits, priced
at the map's KLD times the score error the blocks promise on the choice text (``promised``:
an estimate, as Frontier VI priced byte scales). ``--vq`` adds the vq2hs values' map.

``--tier N:CODEC`` adds ``tier=N:CODEC`` (kv/store.py: the N tokens before the exact residual in
a finer codec) to every row but fp16; the rows then also print the effective bits the cache
counted at the end of a window (the residual, sinks, key center and tier included).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import minillama.model.llama as llama_module
from minillama.app.default_model import resolve_model
from minillama.errors import UserError
from minillama.eval.allocation import allocate_from_maps, choices_from_maps
from minillama.eval.datasets import load as load_text
from minillama.eval.perplexity import evaluate
from minillama.kv.allocate import Choice, allocate
from minillama.kv.quantize import frequency_block_order, gaussian_codebook
from minillama.kv.spec import codec_named, parse_kv
from minillama.model.loader import load_model

HEAD_DIM = 64
KEYS_ONLY = "v=fp16,group=64,residual=8,sinks=4,center=1"
MAPS = [  # the maps k3v2mixb was allocated from, in its order (docs/quality.md, Frontier III and VI)
    f"bench/results/sensitivity_{name}_hamlet_w1.json" for name in ("k4v4lmc", "k4v3lmc", "k3v2lm", "k2v2lmc")
]
VQ_MAP = "bench/results/sensitivity_k2vq2hsc_hamlet_w1.json"  # vq2hs values (Frontier IV)
MIX_BODY_BITS = 2.81  # k3v2mixb's budget


def lloyd_max_error(bits: int) -> float:
    """Squared error per unit variance of the Gaussian Lloyd-Max book (1.0 at 0 bits: the block dropped)."""
    if bits == 0:
        return 1.0
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))
    levels = gaussian_codebook(bits)
    nearest = levels[torch.bucketize(x, (levels[1:] + levels[:-1]) / 2)]
    return (nearest - x).pow(2).mean().item()


def queries_and_keys(lm, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (q (Hq, T, D), k (Hkv, T, D)) after RoPE over one no-cache forward of ids: the model's
    attention call is wrapped for the length of this forward (a bench script's spy, not a hook
    the library has)."""
    seen = []
    attend = llama_module.attend

    def spy(q, k, v, *args, **kwargs):
        seen.append((q[0].float(), k[0].float()))
        return attend(q, k, v, *args, **kwargs)

    llama_module.attend = spy
    try:
        with torch.inference_mode():
            lm.model(torch.tensor([ids]))
    finally:
        llama_module.attend = attend
    return seen


def block_weights(q: torch.Tensor, k: torch.Tensor, nb: int, keys_only: bool = False) -> list[list[float]]:
    """Per KV head, per block: Q_b K_b / n, what a unit of Lloyd-Max error in that block costs a
    score (q (Hq, T, D), k (Hkv, T, D); keys centered on their first 128 tokens as the cache centers).
    With `keys_only` every channel's Q is 1: what a cache that never sees the queries could weigh."""
    n = HEAD_DIM // nb
    order = frequency_block_order(HEAD_DIM, nb)
    blocks = [order[i * n : (i + 1) * n] for i in range(nb)]
    hkv = k.shape[0]
    r = q.shape[0] // hkv
    heads = []
    for h in range(hkv):
        kc = k[h] - k[h, :128].mean(0)  # (T, D)
        k2, q2 = kc.pow(2).mean(0), q[h * r : (h + 1) * r].reshape(-1, HEAD_DIM).pow(2).mean(0)  # (D,) each
        if keys_only:
            q2 = torch.ones_like(q2)
        heads.append([(q2[c].sum() * k2[c].sum() / n).item() for c in blocks])
    return heads


def greedy_bits(weights: list[float], total: int, eps: list[float]) -> list[int]:
    """Bits for each weight, summing to `total`, that minimize sum_i weights_i eps[bits_i]: one
    bit at a time to where it lowers that sum most, none past len(eps) - 1 bits."""
    most = len(eps) - 1
    chosen = [0] * len(weights)
    for _ in range(total):
        gain = [w * (eps[c] - eps[c + 1]) if c < most else -1.0 for w, c in zip(weights, chosen)]
        chosen[gain.index(max(gain))] += 1
    return chosen


def choose_bits(seen, nb: int, bits: int, most: int = 5, keys_only: bool = False) -> list[tuple[tuple[int, ...], ...]]:
    """Per layer, per KV head: the bits of each of nb blocks (summing to nb * bits) that minimize
    sum_b Q_b K_b / n * eps(bits_b), one bit at a time to the block it helps most."""
    eps = [lloyd_max_error(b) for b in range(most + 1)]
    return [
        tuple(tuple(greedy_bits(weight, nb * bits, eps)) for weight in block_weights(q, k, nb, keys_only))
        for q, k in seen
    ]


def promised(seen, nb: int, bits: int) -> list[float]:
    """Per layer, the score error of its chosen blocks over the whole-head rotation's at the same
    code bits: sum_b Q_b K_b / n eps(b_b) against (sum Q)(sum K) / 64 eps(bits), summed over heads."""
    eps = [lloyd_max_error(b) for b in range(6)]
    ratios = []
    for (q, k), alloc in zip(seen, choose_bits(seen, nb, bits)):
        whole = block_weights(q, k, 1)
        got = sum(w * eps[b] for weight, bs in zip(block_weights(q, k, nb), alloc) for w, b in zip(weight, bs))
        ratios.append(got / sum(w[0] * eps[bits] for w in whole))
    return ratios


def block_codecs(seen, nb: int, bits: int, equal: bool = False, keys_only: bool = False) -> list[str]:
    """Per layer, the name of its ``lm{bits}f{nb}`` codec (with `equal`, every block at `bits`:
    the blocks' own rotations and scales without a choice; with `keys_only`, the bits chosen from
    the keys' energy alone)."""
    names = []
    for alloc in choose_bits(seen, nb, bits, keys_only=keys_only):
        if equal:
            alloc = tuple((bits,) * nb for _ in alloc)
        names.append(f"lm{bits}f{nb}:" + ".".join("".join(str(w) for w in head) for head in alloc))
    return names


def keys_only_specs(seen, bits: int) -> dict[str, tuple[str, float]]:
    """Spec -> (label, the keys' bits an element: codes and scales)."""
    specs = {
        "fp16": ("fp16", 16.0),
        f"k=lm{bits}h,{KEYS_ONLY}": (f"keys lm{bits}h", bits + 16 / 64),
        f"k=lm{bits}hb,{KEYS_ONLY}": (f"keys lm{bits}hb", bits + 8 / 64),
    }
    for nb in (2, 4):
        layers = ";".join(f"{name}/fp16" for name in block_codecs(seen, nb, bits))
        label = f"keys {nb} frequency blocks, {bits} bits"
        specs[f"k=lm{bits}h,{KEYS_ONLY},layers={layers}"] = (label, bits + 8 * nb / HEAD_DIM)
    if bits < 4:
        specs[f"k=lm{bits + 1}hb,{KEYS_ONLY}"] = (f"keys lm{bits + 1}hb", bits + 1 + 8 / 64)
    return specs


def equal_specs(seen, bits: int) -> dict[str, tuple[str, float]]:
    """Spec -> (label, the keys' bits an element): where the blocks' gain comes from. Keys only:
    lm{b}hb with a byte scale per 32 rotated channels (the whole-head rotation; the bits of 2
    blocks), 2 blocks with chosen bits, and 2 and 4 blocks with every block at b bits."""
    keys_only = KEYS_ONLY.replace("group=64", "vgroup=64")
    specs = {"fp16": ("fp16", 16.0), f"k=lm{bits}hb,kgroup=32,{keys_only}": (f"keys lm{bits}hb, group 32", bits + 0.25)}
    for nb, equal in ((2, False), (2, True), (4, True)):
        layers = ";".join(f"{name}/fp16" for name in block_codecs(seen, nb, bits, equal))
        label = f"keys {nb} frequency blocks, {bits} bits{' each' if equal else ''}"
        specs[f"k=lm{bits}h,{KEYS_ONLY},layers={layers}"] = (label, bits + 8 * nb / HEAD_DIM)
    return specs


def keys_choice_specs(seen, bits: int) -> dict[str, tuple[str, float]]:
    """Spec -> (label, the keys' bits an element): keys only, lm{b}h, 2 blocks chosen by Q_b K_b,
    and 2 and 4 blocks chosen by the keys' energy alone (what a per-sequence choice could use)."""
    specs = {"fp16": ("fp16", 16.0), f"k=lm{bits}h,{KEYS_ONLY}": (f"keys lm{bits}h", bits + 16 / 64)}
    for nb, keys_only in ((2, False), (2, True), (4, True)):
        layers = ";".join(f"{name}/fp16" for name in block_codecs(seen, nb, bits, keys_only=keys_only))
        label = f"keys {nb} frequency blocks, {bits} bits{', by K' if keys_only else ''}"
        specs[f"k=lm{bits}h,{KEYS_ONLY},layers={layers}"] = (label, bits + 8 * nb / HEAD_DIM)
    return specs


def mix_specs(seen, n_layers: int) -> dict[str, tuple[str, float]]:
    """Spec -> (label, body bits an element of K and V): fp16, k3v2mixb, and its budget spent on blocks."""
    maps = [(path, json.loads(Path(path).read_text())) for path in MAPS]
    specs = {"fp16": ("fp16", 16.0), "k3v2mixb": ("k3v2mixb", MIX_BODY_BITS)}
    for nb, lowered in ((2, False), (2, True), (4, True)):
        extra = (nb - 1) / 16  # the blocks' byte scales beyond lm*hb's one a row, per element of K and V
        budget = MIX_BODY_BITS - extra if lowered else MIX_BODY_BITS
        mix = allocate_from_maps(maps, budget, n_layers, HEAD_DIM, byte_scales=True)
        widths = {k.bits for k, _ in mix.spec.layer_codecs}  # the key widths the mix uses
        keys = {b: block_codecs(seen, nb, b) for b in widths}  # bits -> per-layer names, each table chosen once
        pairs = ";".join(f"{keys[k.bits][layer]}/{v.name}" for layer, (k, v) in enumerate(mix.spec.layer_codecs))
        spec = f"k=lm3hb,v=lm2hb,group=64,residual=8,sinks=4,center=1,layers={pairs}"
        label = f"its budget, keys in {nb} blocks" if lowered else f"its layers, keys in {nb} blocks"
        specs[spec] = (label, mix.bits + extra)
    return specs


def joint(seen, maps, n_layers: int, bits: float, nb: int) -> tuple[str, float]:
    """``kv allocate`` at `bits` with every key choice of the maps offered twice: as priced, and as
    the nb-block codec of its code bits (3 + 8 nb / 64 bits for 3, ...) at the map's KLD times
    the layer's `promised` ratio (an estimate from the choice text, as Frontier VI priced byte
    scales). Returns (spec, body bits an element of K and V)."""
    _, choices, _ = choices_from_maps(maps, n_layers, HEAD_DIM, byte_scales=True)
    names, ratios = {}, {}
    for layer in range(n_layers):
        offered = []
        for c in choices[2 * layer]:
            b = c.codec.bits
            if b not in names:
                names[b], ratios[b] = block_codecs(seen, nb, b), promised(seen, nb, b)
            offered.append(Choice(codec_named(names[b][layer]), b + 8 * nb / HEAD_DIM, c.cost * ratios[b][layer]))
        choices[2 * layer] = choices[2 * layer] + offered
    chosen = [options[i] for options, i in zip(choices, allocate(choices, bits))]
    pairs = ";".join(f"{chosen[2 * i].codec.name}/{chosen[2 * i + 1].codec.name}" for i in range(n_layers))
    return f"k=lm3hb,v=lm2hb,group=64,residual=8,sinks=4,center=1,layers={pairs}", sum(c.bits for c in chosen) / len(
        chosen
    )


def frontier_specs(
    seen, n_layers: int, bits: float, vq: bool = False, split: bool = False
) -> dict[str, tuple[str, float]]:
    """Spec -> (label, body bits an element of K and V): fp16, the maps' allocation at `bits`,
    2-block keys at floor(`bits`) bits in every layer with values allocated from the maps so that
    K and V average `bits`, and the joint allocation of block keys and values (``joint``) for 2 and 4
    blocks. With `vq` the maps include the vq2hs values' map; with `split` each joint row is
    followed by its keys alone and its values alone (the other side fp16; bits as the row's)."""
    maps = [(path, json.loads(Path(path).read_text())) for path in MAPS + ([VQ_MAP] if vq else [])]
    mix = allocate_from_maps(maps, bits, n_layers, HEAD_DIM, byte_scales=True)
    specs = {"fp16": ("fp16", 16.0), str(mix.spec): (f"kv allocate at {bits:g}", mix.bits)}
    _, choices, _ = choices_from_maps(maps, n_layers, HEAD_DIM, byte_scales=True)
    values = choices[1::2]  # per layer, its V's priced codecs
    b = int(bits)
    key_bits = b + 8 * 2 / HEAD_DIM
    try:
        chosen = [options[i] for options, i in zip(values, allocate(values, 2 * bits - key_bits))]
    except UserError as e:  # the fixed keys leave the values less than their cheapest codecs
        print(f"  (no row for keys 2 blocks at {b}: {e})")
    else:
        value_bits = sum(c.bits for c in chosen) / n_layers
        pairs = ";".join(f"{k}/{c.codec.name}" for k, c in zip(block_codecs(seen, 2, b), chosen))
        spec = f"k=lm3hb,v=lm2hb,group=64,residual=8,sinks=4,center=1,layers={pairs}"
        specs[spec] = (f"keys 2 blocks at {b}, values {value_bits:.3f}", (key_bits + value_bits) / 2)
    for nb in (2, 4):
        spec, got = joint(seen, maps, n_layers, bits, nb)
        specs[spec] = (f"joint, {nb} blocks", got)
        if split:  # the same layers' keys alone (values fp16), then values alone (keys fp16)
            head, _, pairs = spec.partition("layers=")
            layers = [p.split("/") for p in pairs.split(";")]
            for side, label in ((1, "keys only"), (0, "values only")):
                kept = ";".join("/".join("fp16" if i == side else c for i, c in enumerate(kv)) for kv in layers)
                specs[f"{head}layers={kept}"] = (f"  {label}", got)
    return specs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("windows", type=int, help="W windows of N tokens (P 128) from token 0")
    ap.add_argument("--tokens", type=int, default=896, help="N, each window's tokens (default 896)")
    ap.add_argument("--dataset", default="hamlet", help="the evaluated text (eval/datasets.py)")
    ap.add_argument("--text", help="a UTF-8 text file to evaluate instead of --dataset")
    ap.add_argument("--choose", help="a UTF-8 text file to choose the bits on (default: Hamlet)")
    ap.add_argument("--bits", type=int, default=3, choices=(2, 3, 4), help="keys' bits an element, keys only")
    ap.add_argument("--mix", action="store_true", help="k3v2mixb's budget spent on blocks")
    ap.add_argument("--frontier", type=float, metavar="BITS", help="block keys, values by the maps, K and V at BITS")
    ap.add_argument("--vq", action="store_true", help="with --frontier: the vq2hs values' map as well")
    ap.add_argument("--split", action="store_true", help="with --frontier: each joint row's keys and values alone")
    ap.add_argument("--equal", action="store_true", help="keys only: blocks at equal bits, lm*hb at group 32")
    ap.add_argument("--by-keys", action="store_true", help="keys only: bits chosen from the keys' energy alone")
    ap.add_argument("--table", type=int, choices=(2, 4), metavar="NB", help="print the keys-only spec of NB blocks")
    ap.add_argument("--tier", metavar="N:CODEC", help="an age tier in every row but fp16 (tier=N:CODEC)")
    ap.add_argument("--specs", action="store_true", help="print each row's label and --kv spec, evaluate nothing")
    args = ap.parse_args()
    choice_text = Path(args.choose).read_text(encoding="utf-8") if args.choose else load_text("hamlet")
    text = Path(args.text).read_text(encoding="utf-8") if args.text else load_text(args.dataset)
    lm = load_model(resolve_model(None), "float32")
    seen = queries_and_keys(lm, lm.tokenizer.encode(choice_text)[:896])
    n_layers = lm.config.num_hidden_layers
    if args.table:
        print(
            f"k=lm{args.bits}hb,{KEYS_ONLY},layers="
            + ";".join(f"{k}/fp16" for k in block_codecs(seen, args.table, args.bits))
        )
        return
    if args.frontier:
        specs = frontier_specs(seen, n_layers, args.frontier, args.vq, args.split)
    elif args.equal:
        specs = equal_specs(seen, args.bits)
    elif args.by_keys:
        specs = keys_choice_specs(seen, args.bits)
    else:
        specs = mix_specs(seen, n_layers) if args.mix else keys_only_specs(seen, args.bits)
    if args.tier:
        specs = {s if s == "fp16" else f"{s},tier={args.tier}": v for s, v in specs.items()}
    if args.specs:
        for spec, (label, _) in specs.items():
            print(f"{label}: {spec}")
        return
    with torch.inference_mode():
        rows = evaluate(
            lm,
            lm.tokenizer.encode(text),
            [parse_kv(s) for s in specs],
            n=args.tokens,
            windows=args.windows,
            blind=False,
        )
    for r, (label, bits) in zip(rows, specs.values()):
        what = "body" if args.mix or args.frontier else "keys"
        counted = f" ({r.bits_per_element:.3f} counted)" if args.tier else ""
        print(
            f"  {label:36s} {what} {bits:6.3f} bits{counted}  ppl {r.ppl:.4f}  Δ {r.delta_pct:+.2f}%  KLD {r.kld_mean:.5f}"
        )


if __name__ == "__main__":
    main()
