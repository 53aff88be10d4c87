"""Several caches decoded as one batch (kv/group.py): each row block gets what its cache alone gives.

A perplexity run compares schemes on the same tokens; as rows of one batch, each decode step
reads the model's weights once for all of them. These tests hold the batched run to the runs
one scheme at a time, on every backend.
"""

from __future__ import annotations

import pytest
import torch

from minillama.errors import UserError
from minillama.eval.perplexity import cached_scores, evaluate, make_windows
from minillama.kv.cache import KVCache
from minillama.kv.group import CacheGroup
from minillama.kv.spec import parse_kv

SPECS = ["fp32", "kivi4", "hadv2", "k4v3lmc"]
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 10


@pytest.fixture(scope="module")
def ids(tiny):
    return tiny.tokenizer.encode(TEXT)


def test_a_group_decodes_each_cache_as_it_would_alone(tiny, ids, each_backend):
    seq = make_windows(ids, 96, 2, 0, None)  # (2, 96)
    caches = [KVCache.for_model(tiny.config, parse_kv(s), 96, batch=2) for s in SPECS]
    group = cached_scores(tiny.model, seq.repeat(len(SPECS), 1), 12, CacheGroup(caches)).nll  # (8, 84)
    for i, spec in enumerate(SPECS):
        alone = cached_scores(tiny.model, seq, 12, KVCache.for_model(tiny.config, parse_kv(spec), 96, batch=2)).nll
        # a batch of 8 rows rounds the projections differently from a batch of 2 in the last bits;
        # the integer kernels' byte rounding can turn that into one step of a weight (1e-3)
        assert torch.allclose(group[2 * i : 2 * i + 2], alone, atol=1e-3), spec
        assert caches[i].held == 96  # every cache got its own rows appended


def test_a_perplexity_run_scores_its_schemes_as_one_batch(tiny, ids, monkeypatch):
    """evaluate() decodes all schemes together (one cached_scores call) and still reports each
    scheme's perplexity and KLD as a run of that scheme alone."""
    specs = [parse_kv(s) for s in SPECS]
    calls = []
    real = cached_scores

    def counted(*args, **kwargs):
        calls.append(args[1].shape[0])  # rows of the batch
        return real(*args, **kwargs)

    monkeypatch.setattr("minillama.eval.perplexity.cached_scores", counted)
    together = evaluate(tiny, ids, specs, n=96, prefill=16, windows=2, blind=False)
    assert calls == [2 * len(specs)]
    for spec, row in zip(specs, together):
        (alone,) = evaluate(tiny, ids, [spec], n=96, prefill=16, windows=2, blind=False)
        assert row.kv == alone.kv and row.tokens_scored == alone.tokens_scored
        assert row.ppl == pytest.approx(alone.ppl, rel=1e-4)
        assert row.kld_mean == pytest.approx(alone.kld_mean, rel=1e-2, abs=1e-6)


def test_caches_of_different_lengths_cannot_share_a_batch(tiny):
    a = KVCache.for_model(tiny.config, parse_kv("fp32"), 96)
    b = KVCache.for_model(tiny.config, parse_kv("kivi4"), 96)
    a.append([(torch.zeros(1, tiny.config.n_kv_heads, 1, tiny.config.head_dim),) * 2] * tiny.config.num_hidden_layers)
    with pytest.raises(UserError, match="differ in length"):
        CacheGroup([a, b])
