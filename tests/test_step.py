"""The native decode step (native/step.py over native/step.cpp) computes what the layers compute.

On the kernels backend a decode step runs every layer in one C++ call: norm, fused q/k/v product,
RoPE, attention over the cache, o_proj, norm, gate/up, SiLU, down. The PyTorch layers in
model/llama.py are its specification. These tests decode the same tokens through both -- the
layer-by-layer path is forced by making the native step unavailable -- and compare the logits of
every step, for every preset, GQA ratio, head_dim, dtype and batch size; and against the
reference backend, which uses no compiled code at all.
"""

from __future__ import annotations

import pytest
import torch

from minillama.kv.cache import KVCache
from minillama.kv.spec import PRESETS, parse_kv
from minillama.native import backend, ops, step
from minillama.native.abi import NotSupported
from minillama.native.fast import load_model
from minillama.native.plans import CachePlans
from minillama.native.token_write import CacheWrites
from tests.conftest import make_tiny

needs_kernels = pytest.mark.skipif(backend.library() is None, reason="the kernels did not build here")

# (query heads, kv heads, head_dim): plain multi-head, GQA 3 with head_dim 128, GQA 8
SHAPES = [(4, 4, 64), (6, 2, 128), (8, 1, 64)]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}-d{s[2]}")
def model_dir(request, tmp_path_factory):
    hq, hkv, d = request.param
    return make_tiny(
        tmp_path_factory.mktemp("step"),
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=d,
        hidden_size=192,
        intermediate_size=160,
        attention_bias=True,
    )


def decode_logits(lm, preset: str, batch: int, steps: int = 10) -> torch.Tensor:
    """Prefill 70 tokens per sequence (past the full-precision window: quantized groups exist),
    then feed `steps` more one at a time (teacher forcing): the logits of every decode step,
    (steps, B, vocab)."""
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, lm.config.vocab_size, (batch, 70 + steps), generator=g)  # (B, T)
    cache = KVCache.for_model(lm.config, parse_kv(preset), 128, batch=batch)
    with torch.inference_mode():
        lm.model(ids[:, :70], cache)
        out = [lm.model(ids[:, t : t + 1], cache)[:, -1].float() for t in range(70, 70 + steps)]
    return torch.stack(out)  # (steps, B, vocab)


def fell_back(ran) -> list[str]:
    """The fallbacks counted in a tally's difference (native/backend.py: tally)."""
    return [k for k in ran if k.startswith("fallback")]


def layer_by_layer(monkeypatch):
    """Make the native step unavailable, as on a cache no kernel reads: the model then runs its
    PyTorch layers, plain PyTorch (model/llama.py)."""

    def refuse(model, lib, batch):
        raise NotSupported("disabled by the test")

    monkeypatch.setattr(step, "native_step", refuse)


@needs_kernels
def test_the_step_silu_rounds_as_torch_silu_does():
    """The step's SiLU (16 lanes at a time with AVX-512, 8 with AVX2, with its own exp) against
    torch's silu(gate) * up: bit for bit in bfloat16 -- every finite gate, from -100 to 100 and
    past exp's range, and a row length that leaves a tail --, within 3 ulp in float32."""
    g = torch.Generator().manual_seed(0)
    gate = torch.cat([torch.randn(3, 900, generator=g) * 6, torch.randn(3, 100, generator=g) * 60], dim=1)
    gate[0, :6] = torch.tensor([0.0, -0.0, 88.0, 89.0, -104.0, 3e38])  # (M, I) with I = 1000
    up = torch.randn(3, 1000, generator=g)
    lib = backend.library()
    bf = torch.cat([gate, up], dim=1).to(torch.bfloat16)
    expected = (torch.nn.functional.silu(bf[:, :1000]) * bf[:, 1000:]).float()
    assert torch.equal(ops.silu_mul(lib, bf).float(), expected)
    exact = torch.nn.functional.silu(gate) * up
    assert torch.allclose(ops.silu_mul(lib, torch.cat([gate, up], dim=1)), exact, rtol=4e-7, atol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_rms_norm_rounds_as_the_model_does(dtype):
    """The step's residual add and RMSNorm (one native call) against model/llama.py's: the sum
    rounded to the dtype, normalized in float32, rounded, times the weight. The sum of squares is
    taken in another order, so a bfloat16 output may sit one rounding step away (rarely)."""
    from minillama.model.llama import RMSNorm

    g = torch.Generator().manual_seed(1)
    x, h = torch.randn(4, 576, generator=g).mul(3).to(dtype), torch.randn(4, 576, generator=g).to(dtype)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=g).add(0.5))
        total, normed = ops.add_rms_norm(backend.library(), x, h, norm.weight, 1e-5)
        assert torch.equal(total, x + h)
        expected = norm(x + h)
    step = 2.0**-7 if dtype == torch.bfloat16 else 1e-6  # bfloat16's relative rounding step; float32: the sums' order
    assert torch.allclose(normed.float(), expected.float(), rtol=step, atol=0)
    if dtype == torch.bfloat16:
        assert (normed == expected).float().mean() > 0.99
    _, alone = ops.add_rms_norm(backend.library(), x, None, norm.weight, 1e-5)  # no residual: the norm of x
    assert torch.allclose(alone.float(), norm(x).detach().float(), rtol=step, atol=0)


@needs_kernels
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", PRESETS)
def test_the_native_step_gives_the_logits_of_the_layers(model_dir, preset, dtype, batch, monkeypatch):
    """Exact attention kernels on one side (kernels-exact), the PyTorch layers on the other, in the
    model's dtype; the native step runs once per decode step, for every layer."""
    lm = load_model(str(model_dir), dtype)
    before = backend.tally()
    with backend.using("kernels-exact"):
        native = decode_logits(lm, preset, batch)
    ran = backend.tally() - before
    assert fell_back(ran) == []
    assert ran["decode step"] == 10  # one native call per step: embedding, every layer, norm and LM head
    layer_by_layer(monkeypatch)
    before = backend.tally()
    with backend.using("kernels-exact"):
        layers = decode_logits(lm, preset, batch)
    ran = backend.tally() - before
    assert ran["decode step"] == 0 and ran["fallback: decode step: disabled by the test"] == 10
    # float32: float rounding, and on k4v3lmc a value on a boundary of the fitted grid
    # that the other encoder sends to the neighbouring level (2.3e-4, see the next test).
    # bfloat16: a sum that lands on the other side of a bf16 rounding step moves a value by one
    # bf16 step (2^-8 relative), so logits agree to about a percent.
    if dtype == "float32":
        assert torch.allclose(native, layers, atol=1e-3, rtol=1e-4)
        assert torch.equal(native.argmax(-1), layers.argmax(-1))
    else:
        assert (native - layers).abs().max() <= 0.03 * layers.abs().max()
        assert (native.argmax(-1) == layers.argmax(-1)).float().mean() >= 0.9


@needs_kernels
@pytest.mark.parametrize("preset", PRESETS)
def test_the_native_step_matches_the_reference_backend(model_dir, preset):
    """float32, exact attention: no compiled code on one side, the whole step on the other.
    Measured: at most 3e-6 apart, except on k4v3lmc with head_dim 64 (2.3e-4): a value
    that sits on a boundary of the fitted grid gets the neighbouring level from the other
    encoder, and the layer-by-layer kernels path shows the same 2.3e-4 -- the step adds nothing."""
    lm = load_model(str(model_dir), "float32")
    with backend.using("reference"):
        reference = decode_logits(lm, preset, 2)
    before = backend.tally()
    with backend.using("kernels-exact"):
        native = decode_logits(lm, preset, 2)
    assert (backend.tally() - before)["decode step"] == 10
    assert torch.allclose(native, reference, atol=1e-3, rtol=1e-4)
    assert torch.equal(native.argmax(-1), reference.argmax(-1))


@needs_kernels
def test_an_lm_head_the_step_does_not_read_is_a_recorded_fallback(model_dir):
    """The step reads the LM head as contiguous rows; a head stored transposed (the same numbers)
    sends the whole step to the PyTorch layers, with the reason recorded (shown by --debug,
    bench's fallbacks and chat's /stats), and the logits are the layers' logits."""
    lm = load_model(str(model_dir), "float32")
    with backend.using("kernels-exact"):
        native = decode_logits(lm, "fp16", 1, steps=2)
    head = lm.model.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach().t().contiguous().t())  # same values, not contiguous
    lm.model.steps.clear()
    with backend.using("kernels-exact"):
        layers = decode_logits(lm, "fp16", 1, steps=2)
    assert any(r.startswith("decode step: LM head") and "contiguous" in r for r in backend.fallbacks())
    assert torch.allclose(native, layers, atol=1e-3, rtol=1e-4)


@needs_kernels
def test_a_token_outside_the_vocabulary_is_refused_before_the_step_writes(model_dir):
    """The step checks every token id before it writes anything: the cache is unchanged, and the
    PyTorch layers then raise the embedding's own error."""
    lm = load_model(str(model_dir), "float32")
    cache = KVCache.for_model(lm.config, parse_kv("fp16"), 16)
    with torch.no_grad(), backend.using("kernels"):
        lm.model(torch.tensor([[5, 9]]), cache)
        with pytest.raises(IndexError):
            lm.model(torch.tensor([[lm.config.vocab_size]]), cache)
    assert cache.position == 2 and cache.held == 2


@needs_kernels
def test_without_a_cache_the_step_attends_to_its_own_token(model_dir):
    """A single token with no cache: attention over itself alone is its value."""
    lm = load_model(str(model_dir), "float32")
    x = torch.tensor([[5], [9]])  # (B, 1)
    with torch.no_grad():
        with backend.using("reference"):
            reference = lm.model(x)
        with backend.using("kernels"):
            native = lm.model(x)
    assert torch.allclose(native, reference, atol=2e-5, rtol=1e-4)


@needs_kernels
def test_a_dtype_change_between_steps_rebuilds_what_the_step_points_at(model_dir):
    """``.to()`` gives the weights new storage. The fused projections and the native step's
    weight pointers are derived from it and are made again: after bfloat16 -> float32 the step
    computes what the plain PyTorch model computes, and back in bfloat16 what it did before
    (rather than reading the old fused weights, or memory the conversion freed)."""
    lm = load_model(str(model_dir), "bfloat16")
    with backend.using("kernels-exact"):
        before = decode_logits(lm, "fp16", 1)  # builds the bfloat16 step
        lm.model.float()
        as_float = decode_logits(lm, "fp16", 1)
    with backend.using("reference"):
        reference = decode_logits(lm, "fp16", 1)
    assert torch.allclose(as_float, reference, atol=1e-3, rtol=1e-4)
    lm.model.bfloat16()
    with backend.using("kernels-exact"):
        again = decode_logits(lm, "fp16", 1)
    assert torch.allclose(again, before, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("assign", [False, True])
def test_weights_loaded_between_steps_are_the_weights_the_step_uses(model_dir, assign):
    """load_state_dict copies into the parameters the step points at (or, with assign=True,
    replaces them and the step is rebuilt): the next steps use the new weights."""
    lm = load_model(str(model_dir), "float32")
    g = torch.Generator().manual_seed(7)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in lm.model.state_dict().items()}
    with backend.using("kernels-exact"):
        old = decode_logits(lm, "fp16", 1)
        lm.model.load_state_dict(state, assign=assign)
        new = decode_logits(lm, "fp16", 1)
    fresh = load_model(str(model_dir), "float32")
    fresh.model.load_state_dict(state, assign=assign)
    with backend.using("reference"):
        expected = decode_logits(fresh, "fp16", 1)
    assert not torch.allclose(new, old, atol=1e-2)
    assert torch.allclose(new, expected, atol=1e-3, rtol=1e-4)


def decode_through_changes(lm, spec: str) -> torch.Tensor:
    """Logits of decode steps through everything that changes a cache's parts between steps: the
    sinks and residual filling, the first flush (centered keys
    get their center), the ring wrapping and evicting, a truncation, and a reset followed by a
    prefill (new centers, the same parts held as before). (steps, vocab)"""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, lm.config.vocab_size, (1, 200), generator=g)  # (1, T)
    cache = KVCache.for_model(lm.config, parse_kv(spec), 64)
    out = []
    with torch.inference_mode():
        for t in range(110):  # one token at a time from an empty cache: wraps at 64
            if t == 90:
                cache.reset()
                lm.model(ids[:, 150:200], cache)
            out.append(lm.model(ids[:, t : t + 1], cache)[0, -1].float())
            if t == 80:
                cache.truncate(cache.position - 9)  # back into the residual (or a group boundary)
    return torch.stack(out)  # (steps, vocab)


@needs_kernels
@pytest.mark.parametrize(
    "spec",
    [
        "k4v3lmc",  # centered keys, sinks, codebooks
        "k=int4c,v=int2h,group=16,residual=4,sinks=2",
        "k=int2c,v=int4,group=16,residual=4",  # KIVI keys: whole groups at the first flush
        "k=int4c,v=int4,rope=pre,sinks=2,residual=4,group=16",  # keys rotated when read
        "k=fp16,v=fp16,group=16,residual=4,sinks=2,layers=fp16/fp16;lm3h/int2h",  # four groups, each refreshed
    ],
)
def test_plans_kept_between_steps_follow_the_cache(model_dir, spec, monkeypatch):
    """A KVCache describes its layers to the native step once and refreshes the counts and ring
    slots at each step (native/plans.py: CachePlans). Every change of the cache's parts
    must reach the kernels: the step's logits equal those of the same step with the cache
    described anew at every call (its kept plans dropped first), and the PyTorch layers'."""
    lm = load_model(str(model_dir), "float32")
    with backend.using("kernels-exact"):
        kept = decode_through_changes(lm, spec)
    real = CachePlans.refresh
    made = []  # every plan described, kept alive while the step points at it

    def anew(plans, cache, rope):
        made.append(CachePlans(plans.lib, cache, plans.r))
        return real(made[-1], cache, rope)

    monkeypatch.setattr(CachePlans, "refresh", anew)
    with backend.using("kernels-exact"):
        described_anew = decode_through_changes(lm, spec)
    assert torch.allclose(kept, described_anew, atol=2e-5, rtol=1e-4)
    layer_by_layer(monkeypatch)
    with backend.using("kernels-exact"):
        layers = decode_through_changes(lm, spec)
    assert torch.allclose(kept, layers, atol=1e-3, rtol=1e-4)


WRITTEN_IN_STEP = [
    "hadv2",
    "k4v3lmc",  # centered keys: the first append (the centers) is the PyTorch write's
    "k=lm3hb,v=lm2hb,group=32,residual=3,sinks=2,center=1,tier=12:lm4hb",  # a tier: two writes a group
    "k=lm3h,v=lm2h,group=16,residual=3,center=1,layers=lm3h/lm2h;lm4hb/lm2h",  # groups of every other layer
]


def decode_rings(lm, spec: str, steps: int = 12) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """Prefill 40 tokens and decode `steps` more on the kernels backend: the logits of every step
    (steps, vocab), every ring's buffer, and the cache's position."""
    ids = torch.randint(3, lm.config.vocab_size, (1, 40 + steps), generator=torch.Generator().manual_seed(3))
    cache = KVCache.for_model(lm.config, parse_kv(spec), 96)
    with torch.inference_mode(), backend.using("kernels"):
        lm.model(ids[:, :40], cache)
        out = torch.stack([lm.model(ids[:, t : t + 1], cache)[0, -1] for t in range(40, 40 + steps)])
    rings = [r.buf for s in cache.stores for r in (s.sinks, s.residual, *s.body.values(), *s.tier.values())]
    return out, rings, cache.position


@needs_kernels
@pytest.mark.parametrize("spec", WRITTEN_IN_STEP)
def test_the_step_writes_its_token_in_its_own_native_call(model_dir, spec, monkeypatch):
    """The native step makes the cache write last, inside the same call (StepEnds.writes), from a
    description taken before it ran: no second native call, and the rings hold the bytes the
    PyTorch write leaves when it stores the same keys and values after the step."""
    lm = load_model(str(model_dir), "float32")

    def second_call(lib, writes):
        raise AssertionError("the step's token was written by a second native call")

    monkeypatch.setattr(ops, "write_tokens", second_call)
    in_step = decode_rings(lm, spec)
    monkeypatch.setattr(CacheWrites, "describe", lambda self, k, v: None)  # every token by the PyTorch write
    after = decode_rings(lm, spec)
    assert torch.equal(in_step[0], after[0]) and in_step[2] == after[2]
    assert all(torch.equal(a, b) for a, b in zip(in_step[1], after[1]))


@needs_kernels
def test_a_cache_write_the_step_refuses_is_made_after_it_and_recorded(model_dir, monkeypatch):
    """A write the step's kernel refuses stores nothing (all or nothing); the cache then writes the
    token itself and the fallback is recorded with its reason: the same rings and logits."""
    lm = load_model(str(model_dir), "float32")
    spec = WRITTEN_IN_STEP[2]
    expected = decode_rings(lm, spec)
    real = CacheWrites.describe

    def refused(self, k, v):  # a write whose flush count the kernel refuses (a copy: the groups' own stay)
        writes = real(self, k, v)
        if writes is not None:
            writes.array[0].flush = 9999
        return writes

    reasons = []
    monkeypatch.setattr(backend, "fallback", reasons.append)
    monkeypatch.setattr(CacheWrites, "describe", refused)
    got = decode_rings(lm, spec)
    assert torch.equal(expected[0], got[0]) and expected[2] == got[2]
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))
    assert any("decode step's cache write: sizes that do not fit" in r for r in reasons)


@needs_kernels
def test_a_step_made_under_inference_mode_also_runs_outside_it(model_dir):
    """The step keeps its own buffers between calls; made by a first step under
    ``torch.inference_mode`` (as ``ppl`` runs), they must still take a step under ``no_grad``."""
    lm = load_model(str(model_dir), "float32")
    cache = KVCache.for_model(lm.config, parse_kv("hadv2"), 64)
    with backend.using("kernels"):
        with torch.inference_mode():
            lm.model(torch.tensor([[5]]), cache)
        with torch.no_grad():
            out = lm.model(torch.tensor([[7]]), cache)
    assert out.shape == (1, 1, lm.config.vocab_size) and torch.isfinite(out).all()


@needs_kernels
def test_a_group_of_schemes_and_a_batch_past_16_rows_decode_in_the_one_native_call(model_dir, monkeypatch):
    """A perplexity run decodes its windows x schemes as one batch (kv/group.py): 3 caches of 7
    sequences each, 21 rows. The step takes each cache's rows through that cache's own attention
    plan and the projections 16 rows at a time; every row's logits are those of its cache decoded
    alone on the reference backend."""
    from minillama.kv.group import CacheGroup

    lm = load_model(str(model_dir), "float32")
    specs, b, steps = ["fp16", "hadv2", "k4v3lmc"], 7, 4
    ids = torch.randint(3, lm.config.vocab_size, (b, 70 + steps), generator=torch.Generator().manual_seed(0))

    def decode(cache, rows, backend_name):
        with torch.inference_mode(), backend.using(backend_name):
            lm.model(rows[:, :70], cache)
            return torch.stack([lm.model(rows[:, t : t + 1], cache)[:, -1] for t in range(70, 70 + steps)])

    before = backend.tally()
    group = CacheGroup([KVCache.for_model(lm.config, parse_kv(s), 128, batch=b) for s in specs])
    together = decode(group, ids.repeat(len(specs), 1), "kernels-exact")  # (steps, 21, vocab)
    ran = backend.tally() - before
    assert fell_back(ran) == [] and ran["decode step"] == steps
    for j, spec in enumerate(specs):
        alone = decode(KVCache.for_model(lm.config, parse_kv(spec), 128, batch=b), ids, "reference")
        assert torch.allclose(together[:, j * b : (j + 1) * b], alone, atol=1e-3, rtol=1e-4), spec


@needs_kernels
def test_threads_set_for_the_kernels_and_torch_and_the_step_agrees_across_them(model_dir):
    """`--threads N` (native/backend.py: set_threads) reaches the kernels' OpenMP regions and
    PyTorch; a decode step on one thread gives the logits of the step on every core, up to the
    order in which the threads' partial sums merge."""
    lm = load_model(str(model_dir), "float32")
    before = backend.threads()
    try:
        with backend.using("kernels-exact"):
            many = decode_logits(lm, "hadv2", 2)
            backend.set_threads(1)
            assert backend.library().minillama_threads() == 1 and torch.get_num_threads() == 1
            one = decode_logits(lm, "hadv2", 2)
    finally:
        backend.set_threads(before)
    assert torch.allclose(one, many, atol=1e-4, rtol=1e-4)


def test_the_thread_chooser_takes_the_count_whose_probed_steps_are_faster(monkeypatch):
    """native/threads.py: ThreadChooser, on made-up step times: every EVERY steps (the first after
    FIRST) it probes PROBE steps on the other count; it switches only when their median beats the
    chosen count's by the margin, and sets the library's count only when it changes. (The machine
    is made quiet: a process busy beside the test would start probes of its own, as it should.)"""
    from minillama.native import threads
    from minillama.native.threads import ThreadChooser

    monkeypatch.setattr(threads, "others_running", lambda: 0.0)

    class Lib:
        def __init__(self):
            self.calls = []

        def minillama_set_threads(self, n):
            self.calls.append(n)

    def run(chooser, lib, seconds_at, steps):
        for _ in range(steps):
            chooser.before()
            chooser.after(seconds_at[lib.calls[-1] if lib.calls else 2])

    lib = Lib()
    chooser = ThreadChooser(lib, 2)
    run(chooser, lib, {2: 0.010, 1: 0.013}, 3 * ThreadChooser.EVERY)  # alone: every core stays
    assert chooser.counts[chooser.now] == 2 and lib.calls == [1, 2] * 3  # probed three times, kept 2
    run(chooser, lib, {2: 0.035, 1: 0.013}, ThreadChooser.EVERY)  # a core taken: one fewer wins
    assert chooser.counts[chooser.now] == 1 and lib.calls[-1] == 1


def test_a_process_that_starts_mid_reply_is_answered_within_a_few_steps():
    """Steps on the chosen count turning SLOWER times slower than its best start a probe at once,
    not at the next EVERY: beside a process that starts at step 40, one fewer core is chosen by
    step 40 + 2 PROBE + 1."""
    from minillama.native.threads import ThreadChooser

    class Lib:
        calls: list[int] = []

        def minillama_set_threads(self, n):
            self.calls.append(n)

    lib = Lib()
    chooser = ThreadChooser(lib, 2)
    for i in range(40 + 2 * ThreadChooser.PROBE + 1):
        busy = i >= 40
        chooser.before()
        chooser.after({2: 0.035 if busy else 0.010, 1: 0.013}[chooser.set])
    assert chooser.counts[chooser.now] == 1
    assert ThreadChooser.FIRST + ThreadChooser.PROBE < 40 < ThreadChooser.EVERY  # not the periodic probe


def test_a_prompt_chunk_runs_on_one_core_fewer_while_another_process_is_running(monkeypatch):
    """native/threads.py: prefill_threads counts the other processes' running threads
    (/proc/stat's procs_running less this process's own) and takes one core fewer when one is busy."""
    from minillama.native import threads

    monkeypatch.setattr(threads, "others_running", lambda: 1.0)
    assert threads.prefill_threads(2) == 1 and threads.prefill_threads(1) == 1
    monkeypatch.setattr(threads, "others_running", lambda: 0.0)
    assert threads.prefill_threads(2) == 2


@pytest.mark.skipif(not __import__("os").path.exists("/proc/stat"), reason="Linux /proc")
def test_others_running_sees_a_busy_process():
    import subprocess
    import sys
    import time

    from minillama.native.threads import others_running

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        assert others_running(samples=5) >= 0.5
    finally:
        busy.kill()
        busy.wait()
