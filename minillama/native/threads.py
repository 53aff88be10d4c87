"""How many threads a decode step runs on: every core, or one fewer while another process holds one."""

from __future__ import annotations

import statistics


class ThreadChooser:
    """Every core, or one fewer, for the decode step, chosen by timing both now and then.

    The step's threads meet at a barrier many times a step; when another process holds a core, a
    thread that is descheduled stalls the rest, and a step on every core runs at a fraction of its
    speed (docs/speed.md measures it), where one core fewer keeps most of it. So
    every ``EVERY`` steps, from the ``FIRST`` on, ``PROBE`` steps run on the other count; the count
    whose median step is faster by ``MARGIN`` is kept. Alone, the probes cost PROBE / EVERY of the
    difference; the first comes early, so a reply written beside a busy process switches at once."""

    EVERY = 256  # steps between probes
    PROBE = 4  # steps timed on the other count
    FIRST = 8  # the step the first probe starts at (after PROBE steps on the chosen count and a spare)
    MARGIN = 0.9  # the other count is taken when its median step is at most this fraction

    def __init__(self, lib, most: int):
        self.lib, self.counts = lib, (most, most - 1)
        self.now, self.steps, self.set = 0, 0, most
        self.recent: list[float] = []  # the last PROBE steps on the chosen count, seconds
        self.probed: list[float] = []  # the probe's steps on the other count

    def probing(self) -> bool:
        """Whether the next step is a probe's."""
        return self.FIRST <= self.steps % self.EVERY < self.FIRST + self.PROBE

    def before(self) -> None:
        """Set the thread count for the next step."""
        n = self.counts[1 - self.now] if self.probing() else self.counts[self.now]
        if n != self.set:
            self.lib.minillama_set_threads(n)
            self.set = n

    def after(self, seconds: float) -> None:
        """The step just made took `seconds`: keep it, and at the end of a probe choose."""
        probing = self.probing()
        (self.probed if probing else self.recent).append(seconds)
        self.recent = self.recent[-self.PROBE :]
        self.steps += 1
        if probing and len(self.probed) == self.PROBE:
            if statistics.median(self.probed) < self.MARGIN * statistics.median(self.recent):
                self.now = 1 - self.now
                self.recent = self.probed
            self.probed = []
