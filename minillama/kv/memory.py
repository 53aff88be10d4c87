"""Refuse a cache that cannot fit before allocating it, with the number and what to do.

A cache is preallocated whole (``store.layout``), so its size is known before a byte is
taken: if it exceeds the memory available on the device, the user gets one clear line
instead of the allocator's message (or the machine swapping to a halt).
"""

from __future__ import annotations

import os

import torch

from minillama.errors import UserError


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


def check_fits(nbytes: int, what: str, device: torch.device | str) -> None:
    """Raise a UserError when `nbytes` (the closed-form size of `what`) exceed the free memory."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise UserError(
            f"{what} needs {nbytes:,} bytes ({nbytes / 2**30:.1f} GiB) but only {free / 2**30:.1f} GiB "
            f"are free on {torch.device(device).type}: lower --ctx or pick a smaller --kv"
        )
