"""Where the compiled step's weights live (native/weights.py): one buffer, in huge pages, the same values."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from minillama.kv.memory import HUGE_PAGE
from minillama.native.fast import load_model
from minillama.native.weights import fused_rows, pack_weights
from tests.test_cache import vm_flags


def test_a_loaded_model_keeps_every_weight_in_one_buffer(tiny_dir):
    """After loading, every parameter is a view of one storage, ties kept and q/k/v side by side
    (one fused weight), and the values are the checkpoint's."""
    lm = load_model(str(tiny_dir), "float32")
    model = lm.model
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    attn = model.model.layers[0].self_attn
    qkv, _ = fused_rows([attn.q_proj, attn.k_proj, attn.v_proj])
    assert len(storages) == 1 and qkv.untyped_storage().data_ptr() in storages
    assert torch.equal(qkv[: attn.q_proj.weight.shape[0]], attn.q_proj.weight)  # q's rows first
    assert torch.equal(qkv[-attn.v_proj.weight.shape[0] :], attn.v_proj.weight)  # then k's, then v's
    if lm.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    from safetensors.torch import load_file

    saved = load_file(str(tiny_dir / "model.safetensors"))
    compared = [name for name in model.state_dict() if name in saved]
    assert len(compared) == len(saved)  # every tensor of the checkpoint
    for name in compared:
        assert torch.equal(model.state_dict()[name], saved[name].float()), name


def test_packing_keeps_values_views_and_ties():
    """pack_weights on a plain module: a tie stays one parameter, a view stays a view of the same
    bytes; values unchanged."""
    torch.manual_seed(0)
    a, b, c = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 16)
    model = nn.Sequential(a, b, c)
    b.weight = nn.Parameter(a.weight.detach().t())  # a view (transposed) of a's storage
    c.weight = a.weight  # a tie
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pack_weights(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert b.weight.data_ptr() == a.weight.data_ptr() and torch.equal(b.weight, a.weight.t())
    assert c.weight is a.weight
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps (not Linux)")
def test_large_weights_asked_for_huge_pages():
    """8 MB of weights: the buffer asked for transparent huge pages before first touch (the
    mapping carries the `hg` flag), as the cache's large rings do."""
    model = nn.Linear(1024, 2048, bias=False)  # 8 MB of float32
    pack_weights(model)
    inside = model.weight.data_ptr() - model.weight.data_ptr() % HUGE_PAGE + HUGE_PAGE  # an aligned page of it
    assert "hg" in vm_flags(inside)
