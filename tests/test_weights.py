"""Where the weights live (model/weights.py): one buffer, in huge pages, the same values."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from minillama.kv.memory import HUGE_PAGE
from minillama.model.loader import load_model
from minillama.model.weights import pack_weights
from tests.test_cache import vm_flags


def test_a_loaded_model_keeps_every_weight_in_one_buffer(tiny_dir):
    """After loading, every parameter and fused projection is a view of one storage, ties and the
    q/k/v views of the fused weight kept, and the values are the checkpoint's."""
    lm = load_model(str(tiny_dir), "float32")
    model = lm.model
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    attn = model.model.layers[0].self_attn
    assert len(storages) == 1 and attn.qkv[0].untyped_storage().data_ptr() in storages
    assert attn.q_proj.weight.data_ptr() == attn.qkv[0].data_ptr()  # q's rows are the fused weight's first
    assert torch.equal(attn.qkv[0][: attn.q_proj.weight.shape[0]], attn.q_proj.weight)
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
    bytes, a derived tuple (here a module's `fused`) is moved with them; values unchanged."""
    torch.manual_seed(0)
    a, b = nn.Linear(8, 16), nn.Linear(16, 8)
    model = nn.Sequential(a, b)
    b.weight = nn.Parameter(a.weight.detach().t())  # a view (transposed) of a's storage
    a.fused = (a.weight.detach()[4:], None)  # rows 4.. of a's weight, not a parameter
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pack_weights(model, [(a, "fused")])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert b.weight.data_ptr() == a.weight.data_ptr() and torch.equal(b.weight, a.weight.t())
    assert a.fused[0].data_ptr() == a.weight[4:].data_ptr()
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps (not Linux)")
def test_large_weights_asked_for_huge_pages():
    """8 MB of weights: the buffer asked for transparent huge pages before first touch (the
    mapping carries the `hg` flag), as the cache's large rings do."""
    model = nn.Linear(1024, 2048, bias=False)  # 8 MB of float32
    pack_weights(model, [])
    inside = model.weight.data_ptr() - model.weight.data_ptr() % HUGE_PAGE + HUGE_PAGE  # an aligned page of it
    assert "hg" in vm_flags(inside)
