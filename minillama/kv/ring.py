"""A fixed-size FIFO of rows in a preallocated tensor: the building block of the cache.

The buffer is (B, H, slots, width) and rows are written by index into it, wrapping
around; nothing is ever reallocated or concatenated into the buffer itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillama.kv.memory import huge_page_zeros


@dataclass(frozen=True)
class RingView:
    """A ring of rows as a reader in place sees it: logical row i is buf[:, :, (start + i) % slots]."""

    buf: torch.Tensor  # (B, H, slots, width)
    start: int  # slot of the oldest row


def ring_buffer(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A ring buffer of zeros; a large one in huge pages (kv/memory.py: huge_page_zeros).

    Decode attention at long context streams the whole cache every step. In 4 KB pages a layer's
    6 MB of fp16 keys and values is 1,500 pages, each a TLB miss and a stop for the hardware
    prefetchers (they do not cross a page); in 2 MB pages it is three."""
    return huge_page_zeros(shape, dtype, device)


class Cursor:
    """Where a ring's rows are: the slot of the oldest and how many are held. The rings of the
    layers that share a codec hold the same rows (kv/layered.py), so they share one cursor: a
    step moves it once for all of them."""

    __slots__ = ("start", "count")

    def __init__(self):
        self.start = 0  # slot of the oldest row
        self.count = 0  # rows held

    def drop_oldest(self, n: int, slots: int) -> None:
        """Forget the n oldest rows of a ring of `slots` slots: its oldest slot moves on, wrapping."""
        self.start = (self.start + n) % max(slots, 1)
        self.count -= n


class Ring:
    def __init__(self, buf: torch.Tensor, cursor: Cursor | None = None):
        """buf (B, H, slots, width): zeros the ring owns, or a view of a buffer rings of several
        layers share (kv/layered.py), with their shared `cursor`."""
        self.buf = buf  # (B, H, slots, width)
        batch, heads, slots, width = buf.shape
        self.slots = slots
        self.row_bytes = batch * heads * width * self.buf.element_size()  # one row across the batch and heads
        self.cursor = cursor if cursor is not None else Cursor()

    @property
    def start(self) -> int:
        return self.cursor.start

    @start.setter
    def start(self, slot: int) -> None:
        self.cursor.start = slot

    @property
    def count(self) -> int:
        return self.cursor.count

    @count.setter
    def count(self, n: int) -> None:
        self.cursor.count = n

    def spans(self, first: int, n: int) -> list[tuple[int, int]]:
        """Slot ranges [a, b) holding n rows starting at logical row `first` (at most two spans)."""
        a = (self.start + first) % max(self.slots, 1)
        if a + n <= self.slots:
            return [(a, a + n)] if n else []
        return [(a, self.slots), (0, a + n - self.slots)]

    def push(self, x: torch.Tensor) -> int:
        """Append rows x (B, H, n, width) after the newest; returns bytes written."""
        n = x.shape[2]
        if self.count + n > self.slots:
            raise RuntimeError(f"ring overflow: {self.count} + {n} rows > {self.slots} slots")
        done = 0
        for a, b in self.spans(self.count, n):
            self.buf[:, :, a:b] = x[:, :, done : done + b - a]
            done += b - a
        self.count += n
        return n * self.row_bytes

    def read(self, first: int = 0, n: int | None = None) -> torch.Tensor:
        """Rows [first, first + n) in age order, (B, H, n, width); a view when not wrapped."""
        n = self.count - first if n is None else n
        spans = self.spans(first, n)
        if len(spans) == 1:
            a, b = spans[0]
            return self.buf[:, :, a:b]
        if not spans:
            return self.buf[:, :, :0]
        return torch.cat([self.buf[:, :, a:b] for a, b in spans], dim=2)

    def restore(self, x: torch.Tensor) -> None:
        """An empty ring's rows as a cache file holds them: x (B, H, n, width) into slots 0..n-1.
        Sets the cursor rather than moving it, so every layer sharing it may restore its own rows."""
        self.buf[:, :, : x.shape[2]] = x
        self.start, self.count = 0, x.shape[2]

    def view(self) -> RingView:
        """The buffer and the slot of its oldest row, as kernels that read rows in place need them."""
        return RingView(self.buf, self.start)

    def drop_oldest(self, n: int) -> None:
        self.cursor.drop_oldest(n, self.slots)

    def drop_newest(self, n: int) -> None:
        self.count -= n

    def clear(self) -> None:
        self.start = self.count = 0

    @property
    def live_bytes(self) -> int:
        return self.count * self.row_bytes

    @property
    def allocated_bytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()
