"""``bits=auto:B`` (kv/auto.py): every layer's K and V codec chosen by the cache from its first
append -- the prompt's prefill -- among lm2hb, lm3hb and lm4hb, at most B body bits on average.

The cost of a candidate is the attention-output error of the prompt's newest queries with that
one tensor coded (sinks and each query's newest residual + tier tokens exact), times the weight of
an error in that layer's output, which model/auto.py measures with the queries. These tests hold that
cost to a plain per-query computation in model space, the weight to its formula, the choice to
its budget and to the same answer for the same input, the cache to the mix it chose (bytes,
logits, the saved file) and the refusals to one line each.
"""

from __future__ import annotations

import pytest
import torch

from minillama.errors import UserError
from minillama.kv.auto import CANDIDATES, QUERIES, Probe, choose, layer_costs
from minillama.kv.budget import formula_live_bytes
from minillama.kv.cache import KVCache
from minillama.kv.codecs import CODECS
from minillama.kv.file import encode, read, restore, write_atomic
from minillama.kv.group import CacheGroup
from minillama.kv.spec import parse_kv
from minillama.model.auto import error_weight, probes
from minillama.model.generate import prefill
from minillama.native import backend
from tests.conftest import decode_on_both_backends

AUTO = "bits=auto:2.6,group=64,residual=4,sinks=2,center=1"


def rows(layers: int, t: int, heads: int = 2, d: int = 64, seed: int = 0, hq: int = 4):
    """Random keys (with a large shared channel, as real keys have), values (L, B, H, t, D) and
    each layer's probe: its newest queries (B, Hq, QUERIES, D), error weight 1."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, 1, heads, t, d, generator=g)
    k[..., 3] += 6.0
    v = torch.randn(layers, 1, heads, t, d, generator=g)
    q = [Probe(torch.randn(1, hq, min(QUERIES, t), d, generator=g), 1.0) for _ in range(layers)]
    return k, v, q


def plain_cost(name: str, tensor: str, k, v, q, sinks: int, window: int, centered: bool, group: int = 64) -> float:
    """The cost written out query by query in model space: each query at position p reads keys
    0..p, exact where p - window <= i or i < sinks, else the tensor as `name` stores it."""
    codec, d = CODECS[name], k.shape[-1]
    r, (t, m) = q.shape[1] // k.shape[1], (k.shape[2], q.shape[2])
    center = codec.to_space(k.mean(2, keepdim=True)).half().float() if centered else 0.0

    def stored(x, c):  # rotate, center, fp16, code, decode, uncenter, rotate back
        y = (codec.to_space(x) - c).half()
        return codec.from_space(codec.decode(codec.encode(y, group), group, d) + c)

    kh = stored(k, center) if tensor == "k" else k
    vh = stored(v, 0.0) if tensor == "v" else v
    errors = []
    for j in range(m):
        p = t - m + j
        exact = torch.tensor([i < sinks or i >= p - window for i in range(p + 1)])
        for h in range(q.shape[1]):
            kv_head = h // r
            keys = torch.where(exact[:, None], k[0, kv_head, : p + 1], kh[0, kv_head, : p + 1])  # (p+1, D)
            values = torch.where(exact[:, None], v[0, kv_head, : p + 1], vh[0, kv_head, : p + 1])
            weights = (keys @ q[0, h, j] / d**0.5).softmax(0)
            exact_weights = (k[0, kv_head, : p + 1] @ q[0, h, j] / d**0.5).softmax(0)
            out, ref = weights @ values, exact_weights @ v[0, kv_head, : p + 1]
            errors.append(float((out - ref).pow(2).sum()))
    return sum(errors) / len(errors)


@pytest.mark.parametrize("centered", [False, True])
def test_a_candidates_cost_is_the_attention_error_of_the_newest_queries(centered):
    k, v, probes = rows(1, 40)
    q = [p.queries[:, :, -6:] for p in probes]  # six queries keep the plain loop short
    with backend.using("reference"):
        k_costs, v_costs = layer_costs(k[0], v[0], q[0], (64, 64), centered, sinks=2, window=4)
        for i, name in enumerate(CANDIDATES):
            for tensor, costs in (("k", k_costs), ("v", v_costs)):
                plain = plain_cost(name, tensor, k[0], v[0], q[0], 2, 4, centered)
                assert costs[i] == pytest.approx(plain, rel=1e-4)


def test_more_bits_cost_less():
    k, v, q = rows(1, 96)
    k_costs, v_costs = layer_costs(k[0], v[0], q[0].queries, (64, 64), True, sinks=2, window=4)
    assert k_costs == sorted(k_costs, reverse=True) and v_costs == sorted(v_costs, reverse=True)


def test_a_short_prompt_still_measures_with_every_token_but_the_sinks_coded():
    k, v, q = rows(1, 8)  # 8 tokens: a window of 60 leaves no body for any query
    k_costs, v_costs = layer_costs(k[0], v[0], q[0].queries, (64, 64), False, sinks=2, window=60)
    assert min(k_costs + v_costs) > 0


@pytest.mark.parametrize("t", [1, 3])
def test_a_prompt_no_longer_than_the_sinks_still_chooses(t):
    k, v, q = rows(2, t)
    chosen = choose(parse_kv("bits=auto:2.6,group=64,residual=4,sinks=4"), k, v, q)
    assert chosen.body_bits(64, 2) <= 2.6


def test_the_choice_stays_within_the_budget_and_repeats():
    k, v, q = rows(4, 120)
    for budget in (2.125, 2.6, 3.3, 4.125):
        spec = parse_kv(f"bits=auto:{budget},group=64,residual=4,sinks=2,center=1")
        chosen = choose(spec, k, v, q)
        assert len(chosen.layer_codecs) == 4
        assert chosen.body_bits(64, 4) <= budget + 1e-9
        assert chosen.layer_codecs == choose(spec, k, v, q).layer_codecs
    assert {c.name for pair in choose(parse_kv("bits=auto:4.125,group=64"), k, v, q).layer_codecs for c in pair} == {
        "lm4hb"
    }
    assert {c.name for pair in choose(parse_kv("bits=auto:2.125,group=64"), k, v, q).layer_codecs for c in pair} == {
        "lm2hb"
    }


def test_the_bits_go_to_the_tensor_whose_error_is_largest():
    k, v, q = rows(3, 120)
    v[1] *= 20.0  # layer 1's values: 400x the squared error of any other tensor's
    chosen = choose(parse_kv("bits=auto:2.5,group=64,residual=4,sinks=2"), k, v, q)
    bits = {
        (layer, t): c.body_bits(64, 64) for layer, pair in enumerate(chosen.layer_codecs) for t, c in zip("kv", pair)
    }
    assert bits[(1, "v")] == max(bits.values()) > CODECS["lm2hb"].body_bits(64, 64)


def test_the_bits_go_to_the_layer_whose_errors_weigh_most():
    k, v, q = rows(3, 120)
    q[2] = Probe(q[2].queries, 1000.0)  # layer 2's output errors weigh 1000x downstream
    chosen = choose(parse_kv("bits=auto:2.5,group=64,residual=4,sinks=2"), k, v, q)
    assert {c.name for c in chosen.layer_codecs[2]} != {"lm2hb"}
    assert {c.name for pair in chosen.layer_codecs[:2] for c in pair} == {"lm2hb"}


def test_a_layers_error_weight_is_o_proj_over_the_typical_residual_norm(tiny):
    """Layer 0's weight from the embeddings it reads, written out: ||W_o||_F^2 / median_t ||x_t||^2."""
    tokens = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    layer = tiny.model.model.layers[0]
    x = tiny.model.model.embed_tokens(tokens)  # (1, 20, hidden): the stream entering layer 0
    expected = layer.self_attn.o_proj.weight.pow(2).sum() / x.pow(2).sum(-1).median()
    assert error_weight(layer, x) == pytest.approx(float(expected), rel=1e-5)
    k, v, handed = probes(tiny.model, tokens)  # what the cache is handed with the first chunk
    assert len(handed) == 2 and handed[0].weight == pytest.approx(float(expected), rel=1e-5)
    assert handed[0].queries.shape == (1, 4, 20, 64)  # every query of a prompt shorter than QUERIES
    assert k.shape == v.shape == (2, 1, 2, 20, 64)  # (L, B, H_kv, T, D)


def test_without_probes_each_tensor_is_priced_by_its_own_error():
    k, v, _ = rows(3, 120)
    v[2] *= 20.0
    chosen = choose(parse_kv("bits=auto:2.5,group=64,residual=4,sinks=2"), k, v, None)
    assert chosen.layer_codecs[2][1].name != "lm2hb"


def test_a_cache_chooses_at_its_first_append_and_again_after_a_reset():
    k, v, q = rows(2, 50)
    cache = KVCache(parse_kv(AUTO), n_layers=2, n_kv_heads=2, head_dim=64, capacity=128)
    assert cache.choosing and cache.spec.layer_codecs == ()
    cache.choose(k, v, q)
    cache.append([(k[i], v[i]) for i in range(2)])
    assert not cache.choosing
    assert cache.spec.layer_codecs == choose(parse_kv(AUTO), k, v, q).layer_codecs
    assert cache.layers[1][1].codec is cache.spec.layer_codecs[1][1]  # the stores hold the chosen codecs
    cache.append([(k[i][:, :, :1], v[i][:, :, :1]) for i in range(2)])  # a decode token: no new choice
    assert cache.held == 51
    cache.reset()
    assert cache.choosing and cache.spec.layer_codecs == () and cache.held == 0


def test_the_bytes_held_are_the_closed_form_of_the_chosen_mix():
    k, v, q = rows(2, 90)
    cache = KVCache(parse_kv(AUTO), n_layers=2, n_kv_heads=2, head_dim=64, capacity=128)
    cache.choose(k, v, q)
    cache.append([(k[i], v[i]) for i in range(2)])
    assert cache.live_bytes() == formula_live_bytes(2, 2, 64, cache.spec, 90)


def test_a_group_hands_each_auto_cache_its_own_rows():
    k, v, q = rows(2, 60)
    k2, v2, q2 = rows(2, 60, seed=1)
    alone = [KVCache(parse_kv(AUTO), 2, 2, 64, 128) for _ in range(2)]
    alone[0].choose(k, v, q)
    alone[1].choose(k2, v2, q2)
    grouped = [KVCache(parse_kv("fp16"), 2, 2, 64, 128), *(KVCache(parse_kv(AUTO), 2, 2, 64, 128) for _ in range(2))]
    group = CacheGroup(grouped)
    assert group.choosing
    both_k, both_v = torch.cat([k, k, k2], dim=1), torch.cat([v, v, v2], dim=1)  # (L, 3, H, T, D)
    group.choose(both_k, both_v, [Probe(torch.cat([q[i].queries, q[i].queries, q2[i].queries]), 1.0) for i in range(2)])
    assert not group.choosing
    assert [c.spec.layer_codecs for c in grouped[1:]] == [c.spec.layer_codecs for c in alone]


def test_the_model_hands_its_queries_and_decodes_as_the_chosen_mix(tiny, each_backend):
    """After the prefill an auto cache is the `layers=` spec it chose: the same logits as a cache
    made with that spec from the start, on either backend."""
    tokens = torch.randint(0, 300, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        cache = KVCache.for_model(tiny.config, parse_kv(AUTO), 128)
        prefill(tiny.model, tokens[:, :50], cache)  # chooses from the queries (model/auto.py), then writes
        chosen = cache.spec
        fixed = KVCache.for_model(
            tiny.config, parse_kv(chosen.canonical().replace("bits=auto:2.6", "k=lm4hb,v=lm4hb")), 128
        )
        tiny.model(tokens[:, :50], fixed)
        a = torch.cat([tiny.model(tokens[:, i : i + 1], cache) for i in range(50, 70)], dim=1)
        b = torch.cat([tiny.model(tokens[:, i : i + 1], fixed) for i in range(50, 70)], dim=1)
    assert chosen.layer_codecs and chosen.body_bits(64, 2) <= 2.6 + 1e-9
    assert torch.equal(a, b)


def test_the_model_decodes_an_auto_cache_alike_on_both_backends(tiny):
    reference, native = decode_on_both_backends(tiny, AUTO)
    assert torch.allclose(native, reference, atol=1e-4)


def test_a_saved_auto_cache_keeps_its_choice(tmp_path):
    k, v, q = rows(2, 60)
    cache = KVCache(parse_kv(AUTO), 2, 2, 64, 128)
    cache.choose(k, v, q)
    cache.append([(k[i], v[i]) for i in range(2)])
    path = tmp_path / "auto.mlkv"
    write_atomic(path, encode(cache, list(range(60)), {}))
    back = restore(read(path), None, AUTO)
    assert back.spec.layer_codecs == cache.spec.layer_codecs and not back.choosing
    assert back.layer(1).read(torch.float32)[1].equal(cache.layer(1).read(torch.float32)[1])
    with pytest.raises(UserError, match="holds a --kv"):
        restore(read(path), None, "k=lm3h,v=lm2h,group=64,residual=8,sinks=4")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("bits=auto:abc", "write bits=auto:B"),
        ("bits=3", "write bits=auto:B"),
        ("bits=auto:-1", "write bits=auto:B"),
        ("bits=auto:3,k=lm3h", "drop k="),
        ("bits=auto:3,v=lm4h", "drop v="),
    ],
)
def test_a_malformed_auto_spec_is_refused_in_one_line(spec, message):
    with pytest.raises(UserError, match=message) as e:
        parse_kv(spec)
    assert "\n" not in str(e.value)


def test_a_budget_below_the_cheapest_choice_is_refused():
    with pytest.raises(UserError, match="below the cheapest choice"):
        KVCache(parse_kv("bits=auto:2.0,group=64"), 2, 2, 64, 128)


def test_the_spec_reads_back_from_its_canonical_text():
    spec = parse_kv(AUTO + ",tier=8:lm4hb")
    assert parse_kv(spec.canonical()) == spec
    k, v, q = rows(2, 60)
    chosen = choose(spec, k, v, q)  # a cache's choice is written out in layers= (a saved cache's header)
    again = parse_kv(chosen.canonical())
    assert again.layer_codecs == chosen.layer_codecs and again.auto == 2.6 and chosen.asked() == spec


def test_sensitivity_refuses_an_auto_spec():
    from minillama.eval.sensitivity import variants

    with pytest.raises(UserError, match="chooses them per sequence"):
        variants(parse_kv(AUTO), 2)
