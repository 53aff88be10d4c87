"""A fixed-size FIFO of rows in a preallocated tensor: the building block of the cache.

The buffer is (B, H, slots, width) and rows are written by index into it, wrapping
around; nothing is ever reallocated or concatenated into the buffer itself.
"""

from __future__ import annotations

import torch

from minillama.kv.interface import RingView


class Ring:
    def __init__(self, buf: torch.Tensor):
        """buf (B, H, slots, width): zeros the ring owns, or a view of a buffer rings of several
        layers share (kv/layered.py)."""
        self.buf = buf  # (B, H, slots, width)
        batch, heads, slots, width = buf.shape
        self.slots = slots
        self.row_bytes = batch * heads * width * self.buf.element_size()  # one row across the batch and heads
        self.start = 0  # slot of the oldest row
        self.count = 0  # rows held

    def _spans(self, first: int, n: int) -> list[tuple[int, int]]:
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
        for a, b in self._spans(self.count, n):
            self.buf[:, :, a:b] = x[:, :, done : done + b - a]
            done += b - a
        self.count += n
        return n * self.row_bytes

    def read(self, first: int = 0, n: int | None = None) -> torch.Tensor:
        """Rows [first, first + n) in age order, (B, H, n, width); a view when not wrapped."""
        n = self.count - first if n is None else n
        spans = self._spans(first, n)
        if len(spans) == 1:
            a, b = spans[0]
            return self.buf[:, :, a:b]
        if not spans:
            return self.buf[:, :, :0]
        return torch.cat([self.buf[:, :, a:b] for a, b in spans], dim=2)

    def view(self) -> RingView:
        """The buffer and the slot of its oldest row, as kernels that read rows in place need them."""
        return RingView(self.buf, self.start)

    def drop_oldest(self, n: int) -> None:
        self.start = (self.start + n) % max(self.slots, 1)
        self.count -= n

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
