"""Evaluation texts fetched from the Hugging Face hub (cached after the first download)."""

from __future__ import annotations

from minillama.errors import UserError

WIKITEXT_REPO = "Salesforce/wikitext"
WIKITEXT_FILE = "wikitext-2-raw-v1/test-00000-of-00001.parquet"


def wikitext2() -> str:
    """wikitext-2-raw-v1 test split joined with "\\n\\n", as HF's perplexity guide does."""
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(WIKITEXT_REPO, WIKITEXT_FILE, repo_type="dataset")
    except Exception as e:
        raise UserError(f"could not download wikitext-2 from the Hugging Face hub ({type(e).__name__}); "
                        "offline? pass a local copy with --text FILE") from None
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading the wikitext-2 parquet file needs pyarrow: pip install pyarrow, or use --text FILE") from None
    return "\n\n".join(pq.read_table(path).column("text").to_pylist())
