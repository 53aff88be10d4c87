"""Memory: refuse a cache that cannot fit before allocating it, and allocate in huge pages.

A cache is preallocated whole (``store.layout``), so its size is known before a byte is
taken: if it exceeds the memory available on the device, the user gets one clear line
instead of the allocator's message (or the machine swapping to a halt).

What a decode step streams every token -- the cache's rings (kv/ring.py) and the model's
weights (model/weights.py) -- is allocated by ``huge_page_zeros``: in 4 KB pages each page is a
TLB miss and a stop for the hardware prefetchers, which do not cross a page.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

from minillama.errors import UserError

HUGE_PAGE = 2 << 20  # bytes: a transparent huge page on x86-64 Linux
MADV_HUGEPAGE = 14


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of zeros; on Linux CPUs a large one (4 MB and more) asks the kernel for transparent
    huge pages first. With THP in "madvise" mode (most distributions) only memory that asks gets
    them: this asks, before the pages are first touched. A kernel that says no (or another OS)
    leaves ordinary zeros."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    nbytes = buf.numel() * buf.element_size()
    if buf.device.type == "cpu" and sys.platform == "linux" and nbytes >= 2 * HUGE_PAGE:
        first = -buf.data_ptr() % HUGE_PAGE  # the aligned huge pages inside the buffer
        span = (nbytes - first) // HUGE_PAGE * HUGE_PAGE
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(buf.data_ptr() + first), ctypes.c_size_t(span), MADV_HUGEPAGE)
    return buf.zero_()


def available_bytes(device: torch.device | str) -> int | None:
    """Free memory on `device` now: MemAvailable on Linux CPUs, the CUDA allocator's free bytes; None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(
    nbytes: int, what: str, device: torch.device | str, advice: str = "lower --ctx or pick a smaller --kv"
) -> None:
    """Raise a UserError when `nbytes` (the closed-form size of `what`) exceed the free memory."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise UserError(
            f"{what} needs {nbytes:,} bytes ({nbytes / 2**30:.1f} GiB) but only {free / 2**30:.1f} GiB "
            f"are free on {torch.device(device).type}: {advice}"
        )
