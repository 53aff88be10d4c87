"""The prefill chunk's causal attention kernel (native/prefill_attention.cpp) equals the explicit
masked softmax of model/attention.py, on every build this CPU can run (conftest.py: ``lib``).

A chunk of T new queries attends its past of P keys and itself causally: query t sees keys
0 .. P + t. The kernel takes grouped-query attention (R query heads per KV head), head_dim 64,
80, 96, 128 or 256, and any strides with contiguous channels; other inputs are refused with the reason,
and the layers then take PyTorch's SDPA (native/step.py: chunk_attention).
"""

from __future__ import annotations

import pytest
import torch

from minillama.model.attention import PLAIN, attend, sdpa
from minillama.native import backend, ops, step
from minillama.native.abi import NotSupported


def explicit(q, k, v):
    """The specification: attend's explicit masked softmax, the past given as stored plain keys."""
    t = q.shape[2]
    past = (k[:, :, :-t], v[:, :, :-t])
    return attend(q, k[:, :, -t:], v[:, :, -t:], past, PLAIN, PLAIN)


def tensors(b, hq, hkv, t, past, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g) * 2  # scores spread over several units, as a model's do
    k = torch.randn(b, hkv, past + t, d, generator=g) * 2
    v = torch.randn(b, hkv, past + t, d, generator=g)
    return q, k, v


HEADS = [(1, 1), (4, 4), (9, 3), (8, 2), (16, 1), (32, 8)]
CHUNKS = [(1, 0), (5, 0), (37, 70), (200, 0), (130, 3)]
# Every shape at 64 and 128; the other head sizes Llamas use (a tail of channel vectors in the
# value tile at 80 and 96) on fewer shapes.
CASES = [(h, d, c) for h in HEADS for d in (64, 128) for c in CHUNKS]
CASES += [(h, d, c) for h in [(9, 3), (16, 1)] for d in (80, 96, 256) for c in [(5, 0), (37, 70), (130, 3)]]


@pytest.mark.parametrize("heads,d,chunk", CASES, ids=str)
def test_the_kernel_equals_the_explicit_masked_softmax(lib, heads, d, chunk):
    (hq, hkv), (t, past) = heads, chunk
    q, k, v = tensors(2, hq, hkv, t, past, d, seed=hq + d + t + past)
    out = ops.causal_attention(lib, q, k, v)
    assert out.shape == (2, hq, t, d)
    assert torch.allclose(out, explicit(q, k, v), atol=2e-5, rtol=1e-4)


def test_strided_queries_and_the_layout_of_the_output(lib):
    """Queries as the projection leaves them, (B, T, Hq, D) memory viewed as (B, Hq, T, D), and keys
    sliced out of a longer buffer are read in place; the output is (B, T, Hq, D) in memory, what the
    output projection reads without a copy."""
    q, k, v = tensors(1, 6, 2, 50, 20, 64, seed=3)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_long = torch.cat([k, torch.randn_like(k)], dim=2)[:, :, : k.shape[2]]  # (B, Hkv, L, D), token stride kept
    out = ops.causal_attention(lib, q_strided, k_long, v)
    assert out.transpose(1, 2).is_contiguous()
    assert torch.allclose(out, explicit(q, k, v), atol=2e-5, rtol=1e-4)


def test_a_query_never_sees_a_later_key(lib):
    """Changing the last key and value changes only the last query's output."""
    q, k, v = tensors(1, 3, 1, 40, 10, 64, seed=4)
    before = ops.causal_attention(lib, q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5
    v2[:, :, -1] -= 5
    after = ops.causal_attention(lib, q, k2, v2)
    assert torch.equal(after[:, :, :-1], before[:, :, :-1])
    assert not torch.allclose(after[:, :, -1], before[:, :, -1])


@pytest.mark.parametrize(
    "change,reason",
    [
        (lambda q, k, v: (q.bfloat16(), k, v), "float32"),
        (lambda q, k, v: (q[..., :48], k[..., :48], v[..., :48]), "head_dim"),
        (lambda q, k, v: (q[:, :5], k, v), "query heads per KV head"),
    ],
)
def test_inputs_the_kernel_does_not_take_are_refused_with_the_reason(lib, change, reason):
    q, k, v = change(*tensors(1, 6, 2, 8, 4, 64))
    with pytest.raises(NotSupported, match=reason):
        ops.causal_attention(lib, q, k, v)


def test_the_layers_take_sdpa_where_the_kernel_refuses_and_say_why(lib):
    """chunk_attention on a kernels backend: the native kernel where it applies, PyTorch's SDPA
    (recorded as a fallback) where it does not."""
    fused = step.chunk_attention(lib)
    q, k, v = tensors(1, 4, 2, 9, 3, 64)
    before = backend.tally()
    assert torch.allclose(fused(q, k, v), sdpa(q, k, v), atol=2e-5, rtol=1e-4)
    assert (backend.tally() - before)["prefill attention"] == 1
    q, k, v = tensors(1, 4, 2, 9, 3, 72)  # head_dim 72: no kernel
    before = backend.tally()
    assert torch.allclose(fused(q, k, v), sdpa(q, k, v), atol=1e-6)
    ran = backend.tally() - before
    assert ran["prefill attention"] == 0
    assert [r for r in ran if r.startswith("fallback: prefill attention") and "head_dim" in r]
