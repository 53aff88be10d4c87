"""The cache as a file: saved, inspected, reused, and never trusted when damaged or mismatched."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minillama.app.chat import ChatSession, handle_command
from minillama.app.cli import cli
from minillama.kv.cache import ContextFullError, KVCache
from minillama.kv.file import CacheFileError, read
from minillama.kv.spec import parse_kv
from minillama.model.generate import GenerateOptions, generate, prefill
from minillama.model.prompt_cache import Completion, load_prompt_cache, reuse_prefix, save_prompt_cache
from minillama.model.sampling import SamplingParams
from minillama.native.fast import load_model
from tests.conftest import make_tiny

FAMILIES = [
    "fp16",
    "k=int8,v=int4,group=16,residual=3",  # per-token
    "k=int4c,v=int4,group=32,residual=32",  # KIVI per-channel: 200 tokens leave a partly filled key group
    "hadv2",  # Hadamard values
    "k4v3lmc",  # Lloyd-Max, centered keys, sinks
    "k=lm3hb,v=lm2hb,group=32,residual=8,sinks=2",  # one-byte log scales (uint8 scale parts)
    "k=int2c,v=int3h,residual=5,sinks=2",  # KIVI keys waiting for a whole group
    "k=int4c,v=int2h,group=16,residual=8,sinks=4,rope=pre",
    "k=int4c,v=int2h,residual=8,sinks=4,rope=pre,positions=cache",
]
GREEDY = SamplingParams(temperature=0)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(lm, cache, ids, held=0, logits=None, n=24):
    """n greedy tokens after the prompt `ids`, of which the cache holds the first `held` (all of them
    with `logits`, the last one's)."""
    return [t for t, _ in generate(lm.model, ids, cache, GenerateOptions(n, GREEDY), held=held, logits=logits)]


TIERED = "k=lm3hb,v=lm2hb,group=32,residual=4,sinks=2,center=1,tier=24:lm4hb"  # an age tier (kv/store.py): its rings travel in the file too


def saved_file(lm, tmp_path, spec: str, ids: list[int], capacity: int = 256):
    """Prefill ids into a fresh cache, save it; returns (path, the cache, its last logits)."""
    cache = KVCache.for_model(lm.config, parse_kv(spec), capacity)
    logits = prefill(lm.model, ids, cache)[0]
    path = tmp_path / "p.kv"
    save_prompt_cache(lm, cache, ids, path, logits)
    return path, cache, logits


@pytest.mark.parametrize(
    "spec, capacity",
    [(s, 256) for s in FAMILIES] + [("hadv2", 96), ("k=fp16,v=fp16,sinks=4", 64), (TIERED, 256), (TIERED, 96)],
)
def test_save_load_continues_token_for_token_like_the_uninterrupted_run(tiny, tmp_path, spec, capacity):
    ids = prompt(200)
    path, cache, logits = saved_file(tiny, tmp_path, spec, ids, capacity)
    assert (cache.evicted > 0) == (capacity < 200)  # 96 and 64: the ring wrapped and evicted
    uninterrupted = greedy(tiny, cache, ids, len(ids), logits)
    loaded = load_prompt_cache(tiny, path, spec, capacity)
    c, reused, resumed = reuse_prefix(loaded, ids)
    assert reused == 200 and torch.equal(resumed, logits)  # the exact prompt: nothing prefilled
    assert greedy(tiny, c, ids, len(ids), resumed) == uninterrupted


@pytest.mark.parametrize("spec", ["fp16", "hadv2", "k=int2c,v=int3h,residual=5,sinks=2"])
def test_a_prompt_that_extends_the_cached_one_prefills_only_the_new_tokens(tiny, tmp_path, spec):
    ids = prompt(150)
    path, _, _ = saved_file(tiny, tmp_path, spec, ids)
    longer = ids + prompt(30, seed=1)
    cache, reused, logits = reuse_prefix(load_prompt_cache(tiny, path, spec), longer)
    assert reused == 150 and logits is None and cache.position == 150
    fed = []
    real = tiny.model.forward

    def spy(tokens, *args, **kwargs):
        fed.extend(tokens[0].tolist())
        return real(tokens, *args, **kwargs)

    tiny.model.forward = spy
    try:
        prefill(tiny.model, longer[reused:], cache)
    finally:
        del tiny.model.forward
    assert fed == longer[150:] and cache.position == 180


@pytest.mark.parametrize(
    "spec, kept",
    [
        ("fp16", 120),
        ("k=int8,v=int4,group=16,residual=3", 120),
        # KIVI keys: 120 cuts the quantized group 96..127, back to its start
        ("k=int4c,v=int4,group=32,residual=32", 96),
    ],
)
def test_a_prompt_that_diverges_keeps_the_common_prefix(tiny, tmp_path, spec, kept):
    ids = prompt(200)
    path, _, _ = saved_file(tiny, tmp_path, spec, ids)
    other = ids[:120] + prompt(40, seed=2)
    cache, reused, logits = reuse_prefix(load_prompt_cache(tiny, path, spec), other)
    assert reused == kept and cache.position == kept and cache.held == kept and logits is None


def test_a_prefix_the_ring_evicted_restarts_empty(tiny, tmp_path):
    ids = prompt(200)
    path, _, _ = saved_file(tiny, tmp_path, "k=fp16,v=fp16,sinks=4", ids, capacity=64)
    cache, reused, _ = reuse_prefix(load_prompt_cache(tiny, path, "k=fp16,v=fp16,sinks=4", 64), ids[:100] + [7])
    assert reused == 0 and cache.held == 0


@pytest.mark.parametrize("spec", ["hadv2", "k4v3lmc", "k=int2c,v=int3h,residual=5,sinks=2", TIERED])
def test_the_file_is_the_cache_bytes_plus_a_small_header(tiny, tmp_path, spec):
    """file bytes = the cache's live bytes + token ids and positions (8 bytes each) + the last
    logits (4 x vocab) + the safetensors header, which stays under 4 KiB + 512 bytes per tensor."""
    ids = prompt(200)
    path, cache, _ = saved_file(tiny, tmp_path, spec, ids)
    saved = read(path)
    extra = 8 * len(ids) + 8 * cache.held + 4 * tiny.config.vocab_size
    header = os.path.getsize(path) - sum(cache.live_bytes().values()) - extra
    assert 0 < header < 4096 + 512 * len(saved.tensors)
    assert sum(t.numel() * t.element_size() for t in saved.tensors.values()) == sum(cache.live_bytes().values()) + extra


def test_kv_inspect_shows_the_numbers_stats_shows(tiny, tiny_dir, tmp_path):
    session = ChatSession(tiny, parse_kv("hadv2"), ctx=256, params=GREEDY, max_tokens=40)
    "".join(session.send("tell me a long story about a cat " * 3))
    said = []
    handle_command(session, f"/save {tmp_path / 's.kv'}", said.append)
    assert said[0].startswith("saved 2 messages")
    result = CliRunner().invoke(cli, ["kv", "inspect", str(tmp_path / "s.kv"), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    live = session.cache.live_bytes()
    assert {"kv", "model", "tokens", "cache_bytes", "bits_per_element", "file_bytes", "layers"} <= set(info)
    assert info["kv"] == "hadv2" and info["tokens"] == session.cache.held and info["live_bytes"] == live
    assert info["cache_bytes"] == sum(live.values()) and info["file_bytes"] == os.path.getsize(tmp_path / "s.kv")
    assert f"{info['bits_per_element']:.2f}" in session.stats()
    assert (
        sum(r[t][p] for r in info["layers"] for t in "kv" for p in ("sinks", "body", "residual")) == info["cache_bytes"]
    )
    text = CliRunner().invoke(cli, ["kv", "inspect", str(tmp_path / "s.kv")]).stdout
    assert "kv hadv2" in text and f"{sum(live.values()):,}" in text


# -- files that must not be trusted ---------------------------------------------------------


def damaged(path, how: str):
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) * 2 // 3]))
    elif how == "flipped":  # one byte of the tensors, far from the header
        data[-100] ^= 0x5A
        path.write_bytes(bytes(data))
    elif how == "header flipped":  # one letter of a header key: still JSON, "kv" becomes "jv"
        at = bytes(data).index(b'\\"kv\\"')
        data[at + 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "not safetensors":
        path.write_text("hello, I am a text file\n")
    elif how == "version":
        text = bytes(data).replace(b"minillama-kv-cache/1", b"minillama-kv-cache/9")
        path.write_bytes(text)
    elif how == "directory":
        path.unlink()
        path.mkdir()


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", "is not a readable safetensors file"),
        ("flipped", "does not match its checksum"),
        ("header flipped", "header does not match its checksum"),
        ("not safetensors", "is not a readable safetensors file"),
        ("version", "this minillama reads"),
        ("directory", "is a directory"),
    ],
)
def test_a_damaged_file_is_refused_in_one_line(tiny, tmp_path, how, message):
    path, _, _ = saved_file(tiny, tmp_path, "hadv2", prompt(120))
    damaged(path, how)
    with pytest.raises(CacheFileError, match=message) as e:
        load_prompt_cache(tiny, path, "hadv2")
    assert "\n" not in str(e.value)


def test_another_model_or_spec_or_dtype_is_refused(tiny, tmp_path):
    path, _, _ = saved_file(tiny, tmp_path, "hadv2", prompt(120))
    with pytest.raises(CacheFileError, match="holds a --kv hadv2 cache, not kivi4"):
        load_prompt_cache(tiny, path, "kivi4")
    other = load_model(str(make_tiny(tmp_path / "other", seed=7)), "float32")
    with pytest.raises(CacheFileError, match="another model"):
        load_prompt_cache(other, path, "hadv2")
    bf16 = load_model(str(tmp_path / "other"), "bfloat16")
    with pytest.raises(CacheFileError, match="another"):
        load_prompt_cache(bf16, path, "hadv2")


def test_tensors_out_of_range_are_refused(tiny, tmp_path):
    """A header that claims more rows than the ring has, or token ids past the vocabulary."""
    from safetensors.torch import load_file, save

    path, _, _ = saved_file(tiny, tmp_path, "hadv2", prompt(120))
    from minillama.kv.file import _digest, _header_digest, read_header

    def rewrite():  # a forger's file: every checksum made to match the edited contents
        header["checksums"]["tokens"] = _digest(tensors["tokens"])
        header["header_sha256"] = _header_digest(header)
        path.write_bytes(save(tensors, metadata={"minillama": json.dumps(header)}))

    header = read_header(path)
    tensors = load_file(str(path))
    tensors["tokens"] = tensors["tokens"] + 1000  # ids past the vocabulary of 300
    rewrite()
    with pytest.raises(CacheFileError, match="outside this model's vocabulary"):
        load_prompt_cache(tiny, path, "hadv2")
    header["stores"][0]["rings"]["residual"]["rows"] = 10_000
    rewrite()
    with pytest.raises(CacheFileError, match="more than its ring"):
        load_prompt_cache(tiny, path, "hadv2")


def test_layers_that_hold_their_tokens_differently_are_refused(tiny, tmp_path):
    """Layers that share a codec are written together (kv/layered.py), so a real file has every
    layer's sinks, body and residual alike. A forged one whose layer 1 keeps a sink token in its
    residual instead -- the same count held, every checksum valid -- is refused."""
    from safetensors.torch import load_file, save

    from minillama.kv.file import _digest, _header_digest, read_header

    spec = "k=int4c,v=int4,group=16,residual=8,sinks=4"
    path, _, _ = saved_file(tiny, tmp_path, spec, prompt(120))
    header, tensors = read_header(path), load_file(str(path))
    sinks, residual = tensors["layers.1.k.sinks"], tensors["layers.1.k.residual"]  # (B, H, rows, D)
    tensors["layers.1.k.sinks"] = sinks[:, :, :3].contiguous()
    tensors["layers.1.k.residual"] = torch.cat([sinks[:, :, 3:], residual], dim=2)
    entry = next(e for e in header["stores"] if e["layer"] == 1 and e["tensor"] == "k")
    entry["rings"]["sinks"]["rows"] -= 1
    entry["rings"]["residual"]["rows"] += 1
    for name in ("layers.1.k.sinks", "layers.1.k.residual"):
        header["checksums"][name] = _digest(tensors[name])
    header["header_sha256"] = _header_digest(header)
    path.write_bytes(save(tensors, metadata={"minillama": json.dumps(header)}))
    with pytest.raises(CacheFileError, match="share a codec but hold different rows"):
        load_prompt_cache(tiny, path, spec)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(flips=[(79, 1)], cut=None)  # CI found it: a header key changed, the JSON still valid
@given(
    flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(1, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 10**9)),
)
def test_fuzzed_files_are_refused_or_loaded_but_never_crash(tiny, tmp_path_factory, flips, cut):
    """Random bytes flipped (and maybe the file cut short) anywhere in a real file: loading either
    refuses it with one CacheFileError line or, when the flips left every checked byte intact,
    gives the same continuation as the original file."""
    folder = tmp_path_factory.mktemp("fuzz")
    ids = prompt(90)
    path, cache, logits = saved_file(tiny, folder, "kivi4", ids, capacity=128)
    expected = greedy(tiny, cache, ids, len(ids), logits, n=6)
    data = bytearray(path.read_bytes())
    for at, mask in flips:
        data[at % len(data)] ^= mask
    if cut is not None:
        data = data[: cut % len(data)]
    path.write_bytes(bytes(data))
    try:
        loaded = load_prompt_cache(tiny, path, "kivi4", 128)
    except CacheFileError as e:
        assert "\n" not in str(e)
        return
    c, reused, resumed = reuse_prefix(loaded, ids)
    assert greedy(tiny, c, ids, reused, resumed, n=6) == expected


# -- the library's one-object run (what `minillama generate --prompt-cache` uses) -------------


def test_a_completion_saves_its_prompt_and_the_next_one_resumes_it_token_for_token(tiny, tmp_path):
    """The first run prefills the whole prompt and writes the file once it completes; the second,
    over the same prompt, prefills nothing and samples the same tokens; a longer prompt reuses
    the saved part and prefills only its new tokens."""
    ids, path, spec = prompt(60), tmp_path / "run.kv", parse_kv("hadv2")
    first = Completion(tiny, ids, spec, GenerateOptions(8, GREEDY), capacity=128, prompt_cache=path)
    assert first.note is None and first.reused == 0 and not path.exists()
    tokens = [t for t, _ in first]
    assert path.exists() and len(tokens) == 8
    again = Completion(tiny, ids, spec, GenerateOptions(8, GREEDY), capacity=128, prompt_cache=path)
    assert again.reused == 60 and "reused 60 of 60" in again.note
    assert [t for t, _ in again] == tokens
    longer = Completion(
        tiny, ids + prompt(5, seed=1), spec, GenerateOptions(2, GREEDY), capacity=128, prompt_cache=path
    )
    assert longer.reused == 60
    list(longer)
    assert read(path).tokens == ids + prompt(5, seed=1)  # the longer prompt replaced it


def test_a_completion_stopped_early_or_read_only_leaves_the_file_as_it_was(tiny, tmp_path):
    ids, path, spec = prompt(40), tmp_path / "run.kv", parse_kv("fp16")
    list(Completion(tiny, ids, spec, GenerateOptions(2, GREEDY), capacity=64, prompt_cache=path))
    before = path.read_bytes()
    other = prompt(40, seed=3)
    for _token in Completion(tiny, other, spec, GenerateOptions(8, GREEDY), capacity=64, prompt_cache=path):
        break  # the caller stopped the run: not complete, nothing written
    assert path.read_bytes() == before
    list(Completion(tiny, other, spec, GenerateOptions(2, GREEDY), capacity=64, prompt_cache=path, read_only=True))
    assert path.read_bytes() == before
    with pytest.raises(ContextFullError):  # a full cache ends the run, and the prompt is saved first
        list(Completion(tiny, other, spec, GenerateOptions(60, GREEDY), capacity=48, on_full="stop", prompt_cache=path))
    assert read(path).tokens == other


def test_generate_says_when_logits_and_the_cached_prompt_do_not_go_together(tiny):
    cache = KVCache.for_model(tiny.config, parse_kv("fp16"), 32)
    ids = prompt(5)
    with pytest.raises(ValueError, match="logits go with"):
        list(generate(tiny.model, ids, cache, GenerateOptions(2, GREEDY), held=5))  # whole prompt held, no logits
    with pytest.raises(ValueError, match="logits go with"):
        list(generate(tiny.model, ids, cache, GenerateOptions(2, GREEDY), logits=torch.zeros(tiny.config.vocab_size)))
    with pytest.raises(ValueError, match="not within"):
        list(generate(tiny.model, ids, cache, GenerateOptions(2, GREEDY), held=6))


# -- the command line -------------------------------------------------------------------------


def run_generate(model_dir, prompt_file, cache_file, *extra):
    result = CliRunner().invoke(
        cli,
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt-file",
            str(prompt_file),
            "--kv",
            "hadv2",
            "--max-tokens",
            "12",
            "--prompt-cache",
            str(cache_file),
            *extra,
        ],
    )
    assert result.exit_code == 0, result.output
    return result


def test_generate_reuses_the_file_and_refuses_bad_ones_in_one_line(tiny_dir, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("A long document about cats and dogs. " * 12)
    cache_file = tmp_path / "doc.kv"
    first = run_generate(tiny_dir, text, cache_file)
    assert cache_file.exists() and "reused" not in first.stderr
    second = run_generate(tiny_dir, text, cache_file)
    assert second.stdout == first.stdout
    assert "prompt cache: reused" in second.stderr and "nothing to prefill (all from the cache)" in second.stderr
    good = cache_file.read_bytes()
    for how in ("truncated", "flipped"):
        damaged(cache_file, how)
        bad = cache_file.read_bytes()
        third = run_generate(tiny_dir, text, cache_file)
        assert third.stdout == first.stdout  # the full prefill gives the right answer
        lines = [line for line in third.stderr.splitlines() if "prompt cache not used" in line]
        assert len(lines) == 1 and "Traceback" not in third.output
        assert cache_file.read_bytes() == good != bad  # the completed run wrote a good file over the bad one


def test_generate_leaves_a_bad_file_alone_when_the_run_fails(tiny_dir, tmp_path):
    cache_file = tmp_path / "x.kv"
    cache_file.write_text("not a cache")
    result = CliRunner().invoke(
        cli,
        [
            "generate",
            "--model",
            str(tiny_dir),
            "hello",
            "--kv",
            "hadv2",
            "--ctx",
            "2",
            "--prompt-cache",
            str(cache_file),
        ],
    )
    assert result.exit_code == 1 and cache_file.read_text() == "not a cache"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_chat_resumes_a_saved_session_without_a_prefill(tiny_dir, tmp_path):
    session_file = tmp_path / "s.kv"
    args = [
        "chat",
        "--model",
        str(tiny_dir),
        "--temperature",
        "0",
        "--kv",
        "hadv2",
        "--max-tokens",
        "8",
        "--prompt-cache",
        str(session_file),
    ]
    first = CliRunner().invoke(cli, args, input="hello there\n")
    assert first.exit_code == 0, first.output and session_file.exists()
    second = CliRunner().invoke(cli, args, input="/stats\nand then?\n")
    assert second.exit_code == 0, second.output
    assert "loaded 2 messages and their cache of" in second.stderr and "(no prefill)" in second.stderr
    other_kv = CliRunner().invoke(cli, args[:6] + ["kivi4"] + args[7:], input="again\n")
    assert "its cache is not used" in other_kv.stderr and "holds a --kv hadv2 cache, not kivi4" in other_kv.stderr
