"""Needle in a haystack: can the model still retrieve a fact through the (compressed) cache?

Perplexity on short windows averages errors away and mostly reads exact tokens (prefill
chunks, residual, sinks). KV-compression papers (KIVI, KVQuant, StreamingLLM) judge a
cache by retrieval at long context instead, and so does this module:

* ``passkey`` -- the prompt of the passkey literature (landmark attention, LongLoRA): a
  task line, filler sentences repeated to the length, the line "The pass key is {key}.
  Remember it. {key} is the pass key." at the given depth, then "What is the pass key?
  The pass key is". A random 5-digit key; correct when the first integer generated is it.
* ``multikey`` -- RULER's harder niah_multikey: several needles "One of the special magic
  numbers for {word} is: {number}." with distinct words and 7-digit numbers; one word is
  asked for; correct when its number comes out.

A haystack is a list of sentences, the filler's or a real text's (``--haystack FILE``,
harder: real text competes for attention). Lengths are counted in the model's own
tokens: each piece (task line, every sentence, needle, question) is tokenized once and
the prompt is their concatenation, so the length and the needle's token position are
known exactly; sentences are added while they fit, so a prompt is at most one sentence
short of its length. Depth d puts the needle at the sentence boundary nearest to a
fraction d of the haystack's tokens.

Everything runs on the cached path: the prompt is prefilled in chunks that read the
stored, compressed past, then the answer is decoded greedily token by token from the
cache. The same seed gives the same keys and positions for every scheme (a paired
comparison), and the trials of one cell run as one batch.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minillama.errors import UserError
from minillama.eval.pyplot import pyplot
from minillama.kv.cache import KVCache
from minillama.kv.spec import KVSpec
from minillama.model.generate import PREFILL_CHUNK, prefill
from minillama.model.loader import LoadedModel

TASK = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"
MULTIKEY = "One of the special magic numbers for {word} is: {number}."
MULTIKEY_QUESTION = (
    "What is the special magic number for {word} mentioned in the provided text? "
    "The special magic number for {word} mentioned in the provided text is"
)
WORDS = [
    "apple",
    "river",
    "lantern",
    "violin",
    "harbor",
    "meadow",
    "copper",
    "falcon",
    "glacier",
    "orchid",
    "saddle",
    "thunder",
    "walnut",
    "compass",
    "ember",
    "quartz",
]
TASKS = ("passkey", "multikey")


def split_sentences(text: str) -> list[str]:
    """Sentences of a text: split after . ! or ? followed by whitespace; whitespace runs collapsed."""
    text = re.sub(r"\s+", " ", text).strip()
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


@dataclass
class Trial:
    """One prompt: its token ids, the answer, and where the asked needle sits."""

    ids: list[int]  # (L,) the whole prompt
    answer: int
    needle_at: int  # token index of the asked needle's first token
    needle_len: int
    depth: float


def build_trial(
    tok, task: str, length: int, depth: float, rng: random.Random, haystack: list[str], n_keys: int = 4
) -> Trial:
    """A prompt of at most `length` tokens (at most one haystack sentence short) with the needle at `depth`."""
    if not 0.0 <= depth <= 1.0:
        raise UserError(f"depths are fractions of the haystack from 0 to 1, got {depth}")
    encode = tok.encode
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    head = bos + encode(TASK)
    if task == "passkey":
        answer = rng.randint(10000, 99999)
        needles = [encode(" " + PASSKEY.format(key=answer))]
        question = encode(" " + PASSKEY_QUESTION)
    elif task == "multikey":
        words = rng.sample(WORDS, n_keys)
        numbers = [rng.randint(1_000_000, 9_999_999) for _ in words]
        answer = numbers[0]  # the first needle is the one asked for
        needles = [encode(" " + MULTIKEY.format(word=w, number=n)) for w, n in zip(words, numbers)]
        question = encode(" " + MULTIKEY_QUESTION.format(word=words[0]))
    else:
        raise UserError(f"unknown needle task {task!r}: choose {' or '.join(TASKS)}")
    budget = length - len(head) - len(question) - sum(map(len, needles))
    if budget < 1:
        raise UserError(
            f"length {length} is too short for the {task} prompt: use at least {length - budget + 16} tokens"
        )
    sentences: list[list[int]] = []  # the haystack, sentence by sentence, cycled as needed
    used = 0
    while True:
        piece = encode(" " + haystack[len(sentences) % len(haystack)])
        if used + len(piece) > budget:
            break
        sentences.append(piece)
        used += len(piece)
    # Sentence boundaries: before sentence i the haystack has cum[i] tokens.
    cum = [0]
    for piece in sentences:
        cum.append(cum[-1] + len(piece))
    slot = min(range(len(cum)), key=lambda i: abs(cum[i] - depth * used))  # the asked needle's boundary
    others = [rng.randrange(len(cum)) for _ in needles[1:]]  # distractor needles at random boundaries
    inserts: dict[int, list[list[int]]] = {}
    for boundary, needle in zip([slot, *others], needles):
        inserts.setdefault(boundary, []).append(needle)
    ids = list(head)
    needle_at = -1
    for i in range(len(sentences) + 1):
        for needle in inserts.get(i, []):
            if needle is needles[0]:
                needle_at = len(ids)
            ids += needle
        if i < len(sentences):
            ids += sentences[i]
    ids += question
    return Trial(ids, answer, needle_at, len(needles[0]), depth)


def first_integer(text: str) -> int | None:
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None


@dataclass
class NeedleRow:
    kv: str
    task: str
    length: int
    depth: float
    trials: int
    correct: int
    accuracy: float
    bits_per_element: float
    cache_bytes: int
    evicted: int = 0  # tokens the ring evicted per sequence before the answer (with a --ctx below the length)
    needle_evicted: int = 0  # trials whose asked needle was among them
    answers: tuple = ()  # the first integer each trial generated (None when there was none)

    def to_dict(self) -> dict:
        """The documented JSON row: exactly these keys."""
        keys = ("kv", "task", "length", "depth", "trials", "correct", "accuracy", "bits_per_element", "cache_bytes")
        return {k: getattr(self, k) for k in keys}


@torch.inference_mode()
def answer_batch(
    lm: LoadedModel,
    prompts: list[list[int]],
    cache: KVCache,
    max_new: int,
    chunk: int = PREFILL_CHUNK,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Prefill equal-length prompts (B, L) in chunks through the cache, then decode greedily; the texts.
    `progress` is told the prompt tokens of each chunk prefilled."""
    model = lm.model
    logits = prefill(model, torch.tensor(prompts), cache, chunk, progress)  # (B, V): chunks that read the stored past
    out = []
    for i in range(max_new):
        token = logits.argmax(-1, keepdim=True)  # (B, 1)
        out.append(token)
        if i < max_new - 1:
            logits = model(token, cache)[:, -1]  # (B, V): one token, attending over the whole cache
    generated = torch.cat(out, dim=1).tolist()  # (B, max_new)
    return [lm.tokenizer.decode(row) for row in generated]


def prompt_tokens(specs: list, lengths: list[int], depths: list[float], trials: int) -> int:
    """About how many prompt tokens ``run`` prefills (a prompt is its length give or take a sentence):
    the size of the job, told before it starts."""
    return len(specs) * len(depths) * trials * sum(lengths)


def evicted_needle(trial: Trial, sinks: int, evicted: int) -> bool:
    """Whether the ring dropped the needle: evicted tokens are positions sinks .. sinks + evicted - 1."""
    return trial.needle_at >= sinks and trial.needle_at + trial.needle_len <= sinks + evicted


@dataclass
class Answers:
    """What one batch of equal-length prompts gave through one cache."""

    texts: list[str]  # the generated text of each prompt
    bits_per_element: float
    cache_bytes: int  # per sequence
    evicted: int = 0  # tokens the ring evicted per sequence
    sinks: int = 0  # the ring's sinks (evicted tokens start after them)


Ask = Callable[[object, list[list[int]], int], Answers]  # (scheme, prompts (B, L), max_new) -> answers


def make_cells(
    tokenizer, task: str, lengths: list[int], depths: list[float], trials: int, haystack: list[str] | None, seed: int
) -> list[tuple[int, float, list[Trial]]]:
    """The trials of every (length, depth) cell: the same for every scheme (a paired comparison)."""
    if task not in TASKS:
        raise UserError(f"unknown needle task {task!r}: choose {' or '.join(TASKS)}")
    haystack = haystack or split_sentences(FILLER)
    cells = []
    for length in lengths:
        for depth in depths:
            rng = random.Random(f"{seed}/{task}/{length}/{depth}")  # the same trials for every scheme
            cells.append(
                (length, depth, [build_trial(tokenizer, task, length, depth, rng, haystack) for _ in range(trials)])
            )
    return cells


def score(schemes: list, task: str, cells: list[tuple[int, float, list[Trial]]], ask: Ask) -> list[NeedleRow]:
    """Each scheme's accuracy in every cell; `ask` answers a batch of equal-length prompts through a
    fresh cache of the scheme (minillama's engine below, transformers' in hf/ruler.py)."""
    max_new = 6 if task == "passkey" else 9  # the digits, and room for a space before them
    rows = []
    for scheme in schemes:
        for length, depth, cell in cells:
            answers: list[int | None] = [None] * len(cell)
            correct = evicted = needle_gone = 0
            bits = nbytes = None
            by_len: dict[int, list[int]] = {}
            for i, t in enumerate(cell):  # trials whose prompts have the same token count share one batch
                by_len.setdefault(len(t.ids), []).append(i)
            for members in by_len.values():
                got = ask(scheme, [cell[i].ids for i in members], max_new)
                for i, text in zip(members, got.texts):
                    answers[i] = first_integer(text)
                    correct += answers[i] == cell[i].answer
                    needle_gone += evicted_needle(cell[i], got.sinks, got.evicted)
                evicted = max(evicted, got.evicted)
                bits, nbytes = got.bits_per_element, got.cache_bytes
            rows.append(
                NeedleRow(
                    str(scheme),
                    task,
                    length,
                    depth,
                    len(cell),
                    correct,
                    correct / len(cell),
                    bits,
                    nbytes,
                    evicted,
                    needle_gone,
                    tuple(answers),
                )
            )
    return rows


def run(
    lm: LoadedModel,
    specs: list[KVSpec],
    lengths: list[int],
    depths: list[float],
    trials: int = 1,
    task: str = "passkey",
    haystack: list[str] | None = None,
    ctx: int | None = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[NeedleRow]:
    """Accuracy of every scheme at every (length, depth): the same trials for every scheme.
    `progress` is told the prompt tokens prefilled as they go (``prompt_tokens`` is their total)."""
    cells = make_cells(lm.tokenizer, task, lengths, depths, trials, haystack, seed)

    def ask(spec: KVSpec, prompts: list[list[int]], max_new: int) -> Answers:
        capacity = max(ctx or len(prompts[0]) + max_new, spec.min_capacity)
        cache = KVCache.for_model(lm.config, spec, capacity, batch=len(prompts), device=lm.model.device)
        texts = answer_batch(lm, prompts, cache, max_new, progress=progress)
        nbytes = sum(cache.live_bytes().values()) // len(prompts)
        return Answers(texts, cache.bits_per_element(), nbytes, cache.evicted, spec.sinks)

    return score(specs, task, cells, ask)


def format_table(rows: list[NeedleRow]) -> str:
    """Accuracy per depth (rows) and length (columns) for each scheme, with its bits and cache size."""
    lengths = sorted({r.length for r in rows})
    depths = sorted({r.depth for r in rows})
    lines = [f"needle retrieval ({rows[0].task}), cached path, greedy; accuracy = correct / trials per cell"]
    for kv in dict.fromkeys(r.kv for r in rows):
        mine = {(r.length, r.depth): r for r in rows if r.kv == kv}
        longest = mine[(lengths[-1], depths[0])]
        lines += [
            "",
            f"kv {kv}: {longest.bits_per_element:.2f} bits/element, "
            f"{longest.cache_bytes / 1e6:.1f} MB of cache at {lengths[-1]} tokens",
            f"{'depth':>8}" + "".join(f"{n:>9}" for n in lengths),
        ]
        for d in depths:
            lines.append(f"{d:>8.2f}" + "".join(f"{mine[(n, d)].accuracy:>9.2f}" for n in lengths))
        gone = [r for r in mine.values() if r.evicted]
        if gone:
            lost = sum(r.needle_evicted for r in gone)
            lines.append(
                f"  the cache evicted (up to {max(r.evicted for r in gone)} tokens per prompt); "
                f"{lost} trial(s) lost the needle itself to eviction"
            )
    return "\n".join(lines)


def plot(rows: list[NeedleRow], path: str) -> None:
    """The familiar heatmap: depth x length per scheme, green = retrieved."""
    plt = pyplot()
    kvs = list(dict.fromkeys(r.kv for r in rows))
    lengths = sorted({r.length for r in rows})
    depths = sorted({r.depth for r in rows})
    fig, axes = plt.subplots(1, len(kvs), figsize=(2.2 + 1.1 * len(lengths) * len(kvs), 3.6), squeeze=False)
    for ax, kv in zip(axes[0], kvs):
        acc = {(r.length, r.depth): r.accuracy for r in rows if r.kv == kv}
        grid = [[acc[(n, d)] for n in lengths] for d in depths]
        ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for i, row in enumerate(grid):
            for j, a in enumerate(row):
                ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(kv, fontsize=9)
    axes[0][0].set_ylabel("needle depth")
    fig.suptitle(f"{rows[0].task} retrieval on the cached path")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
