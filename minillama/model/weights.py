"""Where the weights live: all of them in one buffer of huge pages.

A decode step reads every weight once (the default model's ~270 MB in bfloat16): it streams
memory. Loaded tensor by tensor, the weights sit in ordinary 4 KB pages wherever the allocator
put them -- ~66,000 pages a token, each a TLB miss and a stop for the hardware prefetchers, which
do not cross a page. ``pack_weights`` copies them into one buffer that asked the kernel for
transparent huge pages (kv/memory.py: huge_page_zeros), ~135 pages of 2 MB; nothing else changes
(the same bytes, the same parameter names, ties and fused views kept). On the default model
decode steps at 512 tokens took 0.86-0.92x the time (docs/speed.md, "Weights in huge pages").
"""

from __future__ import annotations

import torch
from torch import nn

from minillama.kv.memory import huge_page_zeros

ALIGN = 64  # bytes: every tensor starts on a cache line


def pack_weights(model: nn.Module, derived: list[tuple[nn.Module, str]]) -> None:
    """Move every parameter of `model` into one new buffer, in place: a parameter becomes a
    view of the buffer with its old values, shape and strides. Tensors that share storage keep
    sharing it (tied embeddings, the q/k/v views of a fused weight), and each tensor-tuple
    attribute named in `derived` (``(module, "qkv")``: the fused projections, which are not
    parameters) is re-pointed the same way. On Linux CPUs the buffer is in huge pages."""
    params = [
        (m, name, p) for m in model.modules() for name, p in m.named_parameters(recurse=False, remove_duplicate=False)
    ]
    storages: dict[int, torch.UntypedStorage] = {}  # by address: each storage once
    for _, _, p in params:
        storages.setdefault(p.untyped_storage().data_ptr(), p.untyped_storage())
    for m, name in derived:
        for t in getattr(m, name):
            if t is not None:
                storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
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
    for m, name in derived:
        setattr(m, name, tuple(moved(t) if t is not None else None for t in getattr(m, name)))
