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
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: set it too
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    result = run_ppl("-m", "no-such-org/no-such-model", "--text", text)
    assert result.exit_code == 1 and "cannot load no-such-org/no-such-model" in result.stderr


def test_the_quanto_rows_say_what_to_install_when_quanto_is_missing(tiny_dir, tmp_path, monkeypatch):
    import transformers

    class NoQuanto:
        def __init__(self, *args, **kwargs):
            raise ImportError("optimum-quanto is not installed")

    monkeypatch.setattr(transformers, "QuantizedCache", NoQuanto)  # as transformers says it without quanto
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    result = run_ppl("-m", tiny_dir, "--text", text, "--tokens", 64, "--prefill", 16, "--kv", "hf-quanto4")
    assert result.exit_code == 1 and "pip install optimum-quanto" in result.stderr


def test_transformers_own_caches_are_rows_of_the_same_table(tiny, hf):
    """hf-dynamic (transformers' plain cache) reads exactly; hf-quanto4 (its quantized cache) loses
    a little, and its bytes are counted from the packed tensors it keeps."""
    pytest.importorskip("optimum.quanto", reason="transformers' QuantizedCache rows need optimum-quanto")
    ids = tiny.tokenizer.encode(TEXT)
    dynamic, fp16, quanto = evaluate_hf(hf, "tiny", ids, ["hf-dynamic", "fp16", "hf-quanto4"], n=96, prefill=20)
    assert dynamic.kld_mean < 1e-9 and dynamic.bits_per_element == 32.0  # float32 tensors, as the model runs
    assert 0 < quanto.kld_mean and 4 < quanto.bits_per_element < 16
    assert fp16.cache_bytes * 2 == dynamic.cache_bytes and quanto.cache_bytes < fp16.cache_bytes


def test_minillamas_own_engine_refuses_device_auto(tiny_dir):
    result = CliRunner().invoke(cli, ["generate", "hi", "-m", str(tiny_dir), "--device", "auto"])
    assert result.exit_code == 1 and "add --engine transformers" in result.stderr


def tiny_config(kind: str):
    """A two-layer random config of a model family transformers builds (GQA: 4 query heads, 2 KV)."""
    import transformers

    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)  # fmt: skip
    if kind == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip
        return transformers.LlamaConfig(**shape, rope_parameters=rope)
    if kind == "qwen2":  # q/k/v projections with biases
        return transformers.Qwen2Config(**shape, use_sliding_window=False)
    if kind == "qwen3":  # q/k norms
        if not hasattr(transformers, "Qwen3Config"):
            pytest.skip("this transformers has no Qwen3")
        return transformers.Qwen3Config(**shape, head_dim=16, use_sliding_window=False)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_model_families_run_end_to_end_through_the_cache(kind):
    """Random-weight models of three families: an exact minillama cache generates what
    transformers' own does; a 2-bit one runs and counts its bytes."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind)).eval()
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    dynamic = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=DynamicCache(config=model.config))
    exact = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=minillama_cache(
        model.config, parse_kv("fp32"), 32))  # fmt: skip
    assert torch.equal(dynamic, exact)
    cache = minillama_cache(model.config, parse_kv("hadv2,residual=4,group=8"), 32)
    model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert 0 < cache.live_bytes() and cache.bits_per_element() < 16


def test_each_layer_keeps_its_cache_on_the_device_of_its_keys():
    """A model spread over devices hands each layer's update keys on that layer's device; the
    layer's store is made there (two devices stood in for by cpu and meta)."""
    cache = minillama_cache(LlamaConfig(num_hidden_layers=2, head_dim=16), parse_kv("fp16"), 16)
    for layer, device in zip(cache.layers, ("cpu", "meta")):
        k = torch.zeros(1, 2, 3, 16, device=device)  # (B, Hkv, T, D)
        layer.lazy_initialization(k, k)
        assert layer.device == torch.device(device)
        assert all(store.residual.buf.device == torch.device(device) for store in layer.cache.layers[0])


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["fp16", "hadv2"])
def test_greedy_generate_through_transformers_equals_minillamas_own(smollm, default_model_dir, kv):
    """The default model, three prompts: transformers with minillama's cache generates the tokens
    minillama's own engine does (reference backend, float32)."""
    from minillama.kv.cache import KVCache
    from minillama.model.generate import GenerateOptions, generate
    from minillama.model.sampling import SamplingParams

    hf = LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,"):
        ids = smollm.tokenizer.encode(prompt)
        with backend.using("reference"):
            cache = KVCache.for_model(smollm.config, parse_kv(kv), 64)
            ours = [t for t, _ in generate(smollm.model, ids, cache, GenerateOptions(16, SamplingParams(0.0)))]
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          past_key_values=minillama_cache(hf.config, parse_kv(kv), 64))  # fmt: skip
        assert out[0, len(ids) :].tolist() == ours, prompt


def test_needle_engine_transformers_retrieves_what_minillamas_own_engine_retrieves(smollm):
    """The same needle prompts through transformers with minillama's cache and through minillama's
    engine (float32, reference): the same answers, bytes and bits per scheme."""
    from transformers import AutoTokenizer

    from minillama.eval import needle as nh
    from minillama.hf.ruler import needle_hf

    hf = LlamaForCausalLM.from_pretrained(smollm.path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm.path)
    kvs, lengths, depths = ["fp16", "hadv2"], [320], [0.2, 0.8]
    theirs = needle_hf(hf, tokenizer, kvs, lengths, depths, trials=2)
    with backend.using("reference"):
        ours = nh.run(smollm, [parse_kv(kv) for kv in kvs], lengths, depths, trials=2)
    for a, b in zip(theirs, ours):
        assert (a.kv, a.depth, a.answers, a.cache_bytes) == (b.kv, b.depth, b.answers, b.cache_bytes)
        assert a.bits_per_element == pytest.approx(b.bits_per_element)  # a mean over layers, then over all
    assert sum(r.correct for r in theirs) >= 6  # the model does retrieve at this length


def test_bench_engine_transformers_counts_what_each_cache_holds(tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    args = ["bench", "--engine", "transformers", "-m", str(tiny_dir), "--text", str(text), "--dtype", "float32",
            "--context", "40", "--decode-tokens", "3", "--kv", "hf-dynamic", "--kv", "fp16", "--kv", "hadv2", "--json"]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    dynamic, fp16, hadv2 = json.loads(result.stdout)
    assert dynamic["cache_bytes"] == 2 * fp16["cache_bytes"] > 2 * hadv2["cache_bytes"] > 0  # float32, fp16, 2-bit
    assert all(row["tokens_per_s"] > 0 and row["context"] == 40 for row in (dynamic, fp16, hadv2))


@pytest.mark.parametrize(
    "command, args, message",
    [
        ("needle", ["--ctx", "100"], "--ctx: not with --engine transformers"),
        ("needle", ["--kv", "k3v2mixt"], "layers= maps are made for the default model"),
        ("bench", ["--fill", "synthetic"], "--fill synthetic: not with --engine transformers"),
        ("bench", ["--context", "100000"], "fewer than --context 100000"),
    ],
)
def test_needle_and_bench_engine_transformers_bad_input_is_one_line(tiny_dir, tmp_path, command, args, message):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    extra = ["--lengths", "128"] if command == "needle" else ["--text", str(text)]
    result = CliRunner().invoke(cli, [command, "--engine", "transformers", "-m", str(tiny_dir), *extra, *args])
    *before, last = result.stderr.strip().splitlines()  # before: transformers' own loading bar, if it loaded
    assert result.exit_code in (1, 2) and message in last, result.stderr
    assert all("Loading weights" in line for line in before), result.stderr


@pytest.mark.slow
def test_the_default_model_scores_the_same_in_both_engines(smollm, english_text):
    """docs/transformers.md's table: the default model in float32 on the same Hamlet window, once
    in minillama's engine (reference) and once in transformers with minillama's cache: within 0.2%
    (the two models' float rounding moves a few values across a quantization boundary), the same
    bytes. (The exact cache's agreement: the greedy test above and the tiny models'.)"""
    kvs = ["kivi4", "hadv2", "k4v3lmc"]
    ids = smollm.tokenizer.encode(english_text)
    with backend.using("reference"):
        ours = evaluate(smollm, ids, [parse_kv(kv) for kv in kvs], n=160, prefill=32, blind=False)
    hf = LlamaForCausalLM.from_pretrained(smollm.path, dtype=torch.float32).eval()
    theirs = evaluate_hf(hf, "smollm2", ids, kvs, n=160, prefill=32)
    for a, b in zip(theirs, ours):
        assert a.ppl == pytest.approx(b.ppl, rel=2e-3), a.kv
        assert a.cache_bytes == b.cache_bytes and a.bits_per_element == pytest.approx(b.bits_per_element), a.kv
