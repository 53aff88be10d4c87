"""``minillama needle``: passkey prompts built in tokens, answered on the cached path."""

from __future__ import annotations

import json
import random

import pytest
import torch
from click.testing import CliRunner

from minillama.app.cli import cli
from minillama.eval import needle as nh
from minillama.kv.cache import KVCache
from minillama.kv.spec import parse_kv

FILLER = nh.split_sentences(nh.FILLER)


@pytest.mark.parametrize("task", nh.TASKS)
@pytest.mark.parametrize("length", [600, 800])
def test_a_prompt_has_the_asked_length_within_one_sentence(tiny, task, length):
    tok = tiny.tokenizer
    trial = nh.build_trial(tok, task, length, 0.5, random.Random(1), FILLER)
    longest = max(len(tok.encode(" " + s)) for s in FILLER)
    assert length - longest < len(trial.ids) <= length
    needle = tok.decode(trial.ids[trial.needle_at : trial.needle_at + trial.needle_len])
    assert str(trial.answer) in needle  # the asked needle carries the answer


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_the_needle_sits_at_its_depth_within_one_sentence(tiny, depth):
    tok = tiny.tokenizer
    trial = nh.build_trial(tok, "passkey", 480, depth, random.Random(2), FILLER)
    head, question = len(tok.encode(nh.TASK)), len(tok.encode(" " + nh.PASSKEY_QUESTION))
    haystack = len(trial.ids) - head - question - trial.needle_len  # filler tokens around the needle
    longest = max(len(tok.encode(" " + s)) for s in FILLER)
    assert abs((trial.needle_at - head) - depth * haystack) <= longest / 2 + 1


def test_the_key_is_parsed_back_from_a_reply():
    assert nh.first_integer(" 60494. Remember") == 60494
    assert nh.first_integer(" the pass key is") is None


def test_the_same_seed_gives_the_same_trials_for_every_scheme(tiny, monkeypatch):
    seen = {}

    def fake_answers(lm, prompts, cache, max_new, **_):
        seen.setdefault(str(cache.spec), []).extend(map(tuple, prompts))
        return [""] * len(prompts)

    monkeypatch.setattr(nh, "answer_batch", fake_answers)
    nh.run(tiny, [parse_kv("fp32"), parse_kv("kivi2")], [300, 400], [0.2, 0.8], trials=3, seed=7)
    assert seen["fp32"] == seen["kivi2"] and len(set(seen["fp32"])) == 12  # 2 lengths x 2 depths x 3 keys


def greedy_full_forward(model, ids, n):
    """The plain reference: no cache, the whole sequence re-run for every new token."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[-n:]


def test_an_fp32_cache_answers_exactly_like_a_full_forward(tiny):
    trial = nh.build_trial(tiny.tokenizer, "passkey", 300, 0.5, random.Random(3), FILLER)
    cache = KVCache.for_model(tiny.config, parse_kv("fp32"), 320)
    (text,) = nh.answer_batch(tiny, [trial.ids], cache, 6, chunk=64)  # several chunks, each reading the stored past
    with torch.no_grad():
        assert text == tiny.tokenizer.decode(greedy_full_forward(tiny.model, trial.ids, 6))


def test_json_rows_have_exactly_the_documented_keys(tiny_dir):
    result = CliRunner().invoke(
        cli,
        [
            "needle",
            "--model",
            str(tiny_dir),
            "--kv",
            "fp16",
            "--kv",
            "hadv2",
            "--lengths",
            "300,400",
            "--depths",
            "0,1",
            "--trials",
            "2",
            "--dtype",
            "float32",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    keys = {
        "kv": str,
        "task": str,
        "length": int,
        "depth": float,
        "trials": int,
        "correct": int,
        "accuracy": float,
        "bits_per_element": float,
        "cache_bytes": int,
    }
    assert len(rows) == 2 * 2 * 2
    for row in rows:
        assert set(row) == set(keys) and all(isinstance(row[k], t) for k, t in keys.items())
        assert row["trials"] == 2 and row["accuracy"] == row["correct"] / 2


def test_an_evicted_needle_is_reported(tiny_dir, tmp_path):
    png = tmp_path / "needle.png"
    result = CliRunner().invoke(
        cli,
        [
            "needle",
            "--model",
            str(tiny_dir),
            "--kv",
            "k=fp16,v=fp16,sinks=4",
            "--lengths",
            "400",
            "--depths",
            "0.1",
            "--ctx",
            "128",
            "--dtype",
            "float32",
            "--plot",
            str(png),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "the cache evicted" in result.stdout and "1 trial(s) lost the needle itself to eviction" in result.stdout
    assert "a needle the ring dropped cannot be retrieved" in result.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lengths", "abc"], "comma-separated numbers"),
        (["--lengths", "32"], "at least 64"),
        (["--depths", "1.5"], "fractions from 0 to 1"),
        (["--lengths", "100", "--task", "multikey"], "too short"),
    ],
)
def test_bad_needle_arguments_are_one_line(tiny_dir, args, message):
    result = CliRunner().invoke(cli, ["needle", "--model", str(tiny_dir), *args])
    assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_the_default_model_retrieves_a_short_passkey_through_an_fp16_cache(smollm):
    rows = nh.run(smollm, [parse_kv("fp16")], [1024], [0.2, 0.8], trials=1)
    assert [r.accuracy for r in rows] == [1.0, 1.0], [r.answers for r in rows]
