"""minillama's cache inside Hugging Face transformers (minillama/hf): a transformers model
generates with it, reads its past as stored exactly as minillama's own engine does (the same
cached-path numbers and bytes), and what cannot apply to a foreign model is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig

from minillama.app.cli import cli
from minillama.errors import UserError
from minillama.eval.perplexity import evaluate
from minillama.hf.cache import MinillamaCache, minillama_cache
from minillama.hf.ruler import evaluate_hf
from minillama.kv.spec import parse_kv
from minillama.native import backend

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 8


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def test_an_exact_minillama_cache_generates_what_transformers_own_cache_does(hf):
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    dynamic = hf.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=DynamicCache(config=hf.config))
    cache = minillama_cache(hf.config, parse_kv("fp32"), 64)
    ours = hf.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache)
    assert torch.equal(dynamic, ours)
    assert cache.get_seq_length() == 23 and cache.bits_per_element() == 32.0  # the last token is never fed


@pytest.mark.parametrize("kv", ["hadv2", "kivi4", "k4v3lmc", "k=lm3hb,v=vq2hs,group=16,residual=3,sinks=2,center=1"])
def test_a_transformers_model_reads_the_cache_as_minillama_reads_it(tiny, hf, kv):
    """The cached-path ruler on the same random model, once in minillama's engine and once in
    transformers with minillama's cache: the same perplexity to float rounding, the same bytes."""
    ids = tiny.tokenizer.encode(TEXT)
    with backend.using("reference"):
        (ours,) = evaluate(tiny, ids, [parse_kv(kv)], n=96, prefill=20, windows=2, blind=False)
    (theirs,) = evaluate_hf(hf, "tiny", ids, [kv], n=96, prefill=20, windows=2)
    assert theirs.ppl == pytest.approx(ours.ppl, rel=2e-3)
    assert theirs.kld_mean == pytest.approx(ours.kld_mean, rel=0.05, abs=1e-6)
    assert (theirs.cache_bytes, theirs.bits_per_element) == (ours.cache_bytes, ours.bits_per_element)


@pytest.mark.parametrize(
    "kv, message",
    [
        ("k=int4c,v=int4,rope=pre", "rope=pre needs the model's own RoPE"),
        ("k3v2auto", "bits=auto chooses codecs from the model's queries"),
        ("k3v2mixt", "layers= maps are made for the default model"),
    ],
)
def test_what_cannot_apply_to_a_foreign_model_is_refused_in_one_line(hf, kv, message):
    with pytest.raises(UserError, match=message):
        minillama_cache(hf.config, parse_kv(kv), 64)


@pytest.mark.parametrize(
    "config, message",
    [
        (MistralConfig(num_hidden_layers=2, sliding_window=4096), "sliding window of 4096 tokens"),
        (LlamaConfig(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"]), "sliding_attention"),
    ],
)
def test_sliding_window_models_are_refused_not_silently_wrong(config, message):
    with pytest.raises(UserError, match=message):
        minillama_cache(config, parse_kv("hadv2"), 64)


def test_a_full_cache_stops_instead_of_evicting_what_transformers_masks_assume_is_held(hf):
    cache = minillama_cache(hf.config, parse_kv("fp16"), 16)
    ids = torch.randint(0, 250, (1, 12))
    with pytest.raises(UserError, match="capacity|full|cache"):
        hf.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert isinstance(cache, MinillamaCache)


def run_ppl(*args):
    return CliRunner().invoke(cli, ["ppl", "--engine", "transformers", *map(str, args)])


def test_ppl_engine_transformers_prints_the_same_table(tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    result = run_ppl("-m", tiny_dir, "--text", text, "--tokens", 64, "--prefill", 16, "--kv", "fp16", "--kv", "hadv2",
                     "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["kv"] for r in rows] == ["fp16", "hadv2"] and rows[0]["kld_mean"] < 1e-6 < rows[1]["kld_mean"]
    assert rows[0]["ppl_blind"] == rows[1]["ppl_blind"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ctx", "64"], "--ctx: not with --engine transformers"),
        (["--kv", "k3v2auto"], "bits=auto chooses codecs"),
        (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--ctx", "64"], "no CUDA GPU|--ctx"),
    ],
)
def test_ppl_engine_transformers_bad_input_is_one_line(tiny_dir, tmp_path, args, message):
    import re

    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    result = run_ppl("-m", tiny_dir, "--text", text, "--tokens", 64, "--prefill", 16, *args)
    assert result.exit_code in (1, 2) and re.search(message, result.stderr), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_unreachable_hub_model_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    result = run_ppl("-m", "no-such-org/no-such-model", "--text", text)
    assert result.exit_code == 1 and "cannot load no-such-org/no-such-model" in result.stderr


def test_the_quanto_rows_say_what_to_install_when_quanto_is_missing(tiny_dir, tmp_path):
    pytest.importorskip("transformers")
    try:
        import optimum.quanto  # noqa: F401

        pytest.skip("optimum-quanto is installed: the row runs instead")
    except ImportError:
        pass
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    result = run_ppl("-m", tiny_dir, "--text", text, "--tokens", 64, "--prefill", 16, "--kv", "hf-quanto4")
    assert result.exit_code == 1 and "pip install optimum-quanto" in result.stderr


def test_minillamas_own_engine_refuses_device_auto(tiny_dir):
    result = CliRunner().invoke(cli, ["generate", "hi", "-m", str(tiny_dir), "--device", "auto"])
    assert result.exit_code == 1 and "add --engine transformers" in result.stderr
