"""Where the compiled step's weights live: q/k/v and gate/up side by side, all in one buffer of huge pages.

The native step multiplies q, k and v (and gate and up) as one matrix each: ``fuse`` makes each
group's weights one tensor, the layers' parameters views of its rows (``fused_rows`` finds the
whole again), so nothing is stored twice and the PyTorch layers, loading and ``state_dict`` are
unchanged.

A decode step reads every weight once (the default model's ~270 MB in bfloat16): it streams
memory. Loaded tensor by tensor, the weights sit in ordinary 4 KB pages wherever the allocator
put them -- ~66,000 pages a token, each a TLB miss and a stop for the hardware prefetchers, which
do not cross a page. ``pack_weights`` copies them into one buffer that asked the kernel for
transparent huge pages (kv/memory.py: huge_page_zeros), ~135 pages of 2 MB; nothing else changes
(the same bytes, the same parameter names, ties and fused views kept): fewer TLB misses in a
step that streams every weight.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from minillama.kv.memory import huge_page_zeros
from minillama.native.abi import NotSupported

ALIGN = 64  # bytes: every tensor starts on a cache line


def concat_rows(layers: list[nn.Linear]) -> None:
    """One (sum of outs, in) weight (and bias) for several projections of the same input: the
    layers' parameters become views of its rows, in order. Projections stored differently (blocks
    of two kinds, as a Q4_K_M file keeps some v rows) stay apart: the step multiplies them apart
    into one row (native/step.cpp: products_apart)."""
    if len({(m.weight.dtype, m.weight.shape[1:], getattr(m, "kind", None)) for m in layers}) > 1:
        return
    weight = torch.cat([m.weight.detach() for m in layers])  # (sum out, in)
    bias = torch.cat([m.bias.detach() for m in layers]) if layers[0].bias is not None else None
    row = 0
    for m in layers:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n


def _adjacent(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The rows of `tensors`, each a contiguous block right after the one before, as one view."""
    first = tensors[0]
    at = first.data_ptr()
    for t in tensors:
        if t.data_ptr() != at or not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
            raise NotSupported("projections not side by side in memory (the step multiplies them as one)")
        at += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())  # (sum out, in) or (sum out,)


def fused_rows(layers: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight (sum of outs, in) and bias of projections that ``concat_rows`` placed side by side."""
    weight = _adjacent([m.weight for m in layers])
    bias = _adjacent([m.bias for m in layers]) if layers[0].bias is not None else None
    return weight, bias


def fuse(model: nn.Module) -> None:
    """Each layer's q/k/v and gate/up side by side, then every weight in one buffer (``pack_weights``)."""
    for layer in model.model.layers:
        concat_rows([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
        concat_rows([layer.mlp.gate_proj, layer.mlp.up_proj])
    pack_weights(model)


def pack_weights(model: nn.Module) -> None:
    """Move every parameter of `model` into one new buffer, in place: a parameter becomes a
    view of the buffer with its old values, shape and strides. Tensors that share storage keep
    sharing it (tied embeddings, the q/k/v views of a fused weight). On Linux CPUs the buffer is
    in huge pages."""
    params = [
        (m, name, p) for m in model.modules() for name, p in m.named_parameters(recurse=False, remove_duplicate=False)
    ]
    storages: dict[int, torch.UntypedStorage] = {}  # by address: each storage once
    for _, _, p in params:
        storages.setdefault(p.untyped_storage().data_ptr(), p.untyped_storage())
    if not storages:
        return
    device = params[0][2].device
    offset, total = {}, 0  # each storage's first byte in the buffer
    for address, s in storages.items():
        offset[address] = total
        total += -(-s.nbytes() // ALIGN) * ALIGN
    buf = huge_page_zeros((total,), torch.uint8, device)  # (total,) bytes
    for address, s in storages.items():
        buf[offset[address] : offset[address] + s.nbytes()].copy_(
            torch.empty(0, dtype=torch.uint8, device=device).set_(s)
        )

    def moved(t: torch.Tensor) -> torch.Tensor:
        """t as a view of the buffer: its storage's place there, in elements, plus its own offset."""
        first = offset[t.untyped_storage().data_ptr()] // t.element_size() + t.storage_offset()
        return torch.empty(0, dtype=t.dtype, device=device).set_(buf.untyped_storage(), first, t.shape, t.stride())

    new: dict[int, nn.Parameter] = {}  # by the old parameter: a tie stays one parameter
    for m, name, p in params:
        if id(p) not in new:
            new[id(p)] = nn.Parameter(moved(p.detach()), requires_grad=p.requires_grad)
        setattr(m, name, new[id(p)])
    del params, storages
    release_free_memory()


def release_free_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim): the weights' old storage,
    and the loader's copies before it, would otherwise stay resident beside the one buffer."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the pages are reused by later allocations instead
