"""How many threads a decode step (ThreadChooser) and a prompt's chunk (prefill_threads) run on:
every core, or one fewer while another process holds one."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path


class ThreadChooser:
    """Every core, or one fewer, for the decode step, chosen by timing both now and then.

    The step's threads meet at a barrier many times a step; when another process holds a core, a
    thread that is descheduled stalls the rest, and a step on every core runs at a fraction of its
    speed (docs/speed.md measures it), where one core fewer keeps most of it. So
    every ``EVERY`` steps, from the ``FIRST`` on, ``PROBE`` steps run on the other count; the count
    whose median step is faster by ``MARGIN`` is kept. Alone, the probes cost PROBE / EVERY of the
    difference; the first comes early, so a reply written beside a busy process switches at once.
    A process that starts or ends mid-reply shows as steps ``SLOWER`` times the best the chosen
    count has made, or, every ``LOOK`` steps, as other processes' threads running (or no longer)
    while every core (or one fewer) is chosen: a probe then starts at once rather than at the next
    ``EVERY``."""

    EVERY = 256  # steps between probes
    PROBE = 4  # steps timed on the other count
    FIRST = 8  # the step the first probe starts at (after PROBE steps on the chosen count and a spare)
    MARGIN = 0.9  # the other count is taken when its median step is at most this fraction
    SLOWER = 1.5  # recent steps this much slower than the chosen count's best start a probe
    LOOK = 32  # steps between looks at the other processes' running threads (others_running)

    def __init__(self, lib, most: int):
        self.lib, self.counts = lib, (most, most - 1)
        self.now, self.steps, self.set = 0, 0, most
        self.recent: list[float] = []  # the last PROBE steps on the chosen count, seconds
        self.probed: list[float] = []  # the probe's steps on the other count
        self.best = float("inf")  # the fastest median of PROBE steps on the chosen count since it was chosen

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
            self.probed, self.best = [], statistics.median(self.recent)
        elif not probing and len(self.recent) == self.PROBE:
            typical = statistics.median(self.recent)
            changed = typical > self.SLOWER * self.best  # slower than this count was
            if self.steps % self.LOOK == 0:  # every core beside a busy process, or one fewer alone
                changed |= (others_running() >= 0.5) != (self.now == 1)
            if changed:  # the machine changed: the next step probes
                self.steps = self.steps // self.EVERY * self.EVERY + self.FIRST
            self.best = min(self.best, typical)


def others_running(samples: int = 3, gap_s: float = 0.0005) -> float:
    """How many threads of other processes were running, on average over a few samples: the
    system's runnable count (/proc/stat: procs_running) less this process's own running threads
    (its OpenMP workers may still be spinning from the last parallel region). 0 where /proc is
    not there (the caller then keeps every core)."""
    seen = []
    for _ in range(samples):
        try:
            stat = Path("/proc/stat").read_text()
            running = int(next(line.split()[1] for line in stat.splitlines() if line.startswith("procs_running")))
            ours = 0
            for task in os.scandir("/proc/self/task"):
                with open(os.path.join(task.path, "stat"), "rb") as f:
                    ours += f.read().rsplit(b")", 1)[1].split()[0] == b"R"
        except (OSError, StopIteration, ValueError, IndexError):
            return 0.0
        seen.append(max(0, running - ours))
        time.sleep(gap_s)
    return statistics.mean(seen)


def prefill_threads(most: int) -> int:
    """Threads for a prefill chunk: one core fewer while another process keeps one busy (the chunk
    is one long parallel region; its threads meet at barriers as a decode step's do), else every
    core. Decided per chunk, so a long prompt follows the machine."""
    return most - 1 if most > 1 and others_running() >= 0.5 else most
