"""How much the host slows a stream of small ops right now, measured by the job itself: the
quiet reference a first tune of a bucket has when the table holds no history for it.

Why a probe, and this one. Load that lasts (other jobs, concurrent tunes on a busy host) can
slow a kernel made of many small ops (the rule's per-expert loop) far more than one made of a
few large ones, in every round alike, so no comparison within a confirmation round sees it.
The job therefore times a fixed stream of small torch ops (the kind of work that such load
slows most) piece by piece, and compares the stream with its fastest piece so far: noise only
ever adds time, and one piece (tens of microseconds) is short enough to slip between
disturbances, so the fastest piece, from the job's start on, is the stream's quiet cost even on
a host loaded from the start, while the stream as a whole pays every disturbance. A reading is
thus a ratio of two times taken now, needing no earlier run.

Not used: ``/proc`` load, pressure and steal time count the job's own measuring and compiling
processes and load that never touches the timed kernels (a GPU's graph replays), and say
nothing of how much a kernel is slowed; a roofline plausibility bound needs per-kernel work
models and the ceilings measured on GPUs only.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Protocol

import torch


class HostProbe(Protocol):
    """What a confirmation reads beside each round (``confirm``'s ``probe``)."""

    def __call__(self) -> float:
        """How many times its quiet cost a stream of small ops takes now: about 1 on a quiet
        host, never below 1."""
        ...


class StreamProbe:
    """``pieces`` small matmul-and-accumulate ops (the per-expert step of the rule's loop, on
    the CPU threads the job's CPU timings use), each timed; a reading is the stream's time over
    ``pieces`` times the fastest piece this probe has timed. Readings from several lanes of a
    job take turns (one at a time, so they do not disturb each other).
    """

    def __init__(self, pieces: int = 32, width: int = 256) -> None:
        self.pieces = pieces
        generator = torch.Generator().manual_seed(0)
        self._x = torch.randn(1, width, generator=generator)
        self._w1 = torch.randn(2 * width, width, generator=generator)
        self._w2 = torch.randn(width, 2 * width, generator=generator)
        self._acc = torch.zeros(1, width)
        self._fastest_us = math.inf
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            times = []
            for _ in range(self.pieces):
                start = time.perf_counter()
                self._acc.add_(torch.relu(self._x @ self._w1.T) @ self._w2.T)
                times.append((time.perf_counter() - start) * 1e6)
            self._fastest_us = min(self._fastest_us, *times)
            return sum(times) / (self.pieces * max(self._fastest_us, 1e-3))
