"""Timing harness: warm-up, repetitions, median and spread, inputs rotated so caches stay cold;
and the confidence interval of a speedup measured round by round.

CPU uses the wall clock around each call. CUDA replays a CUDA graph of several calls (one
launch overhead spread over them, as in serving with graphs) timed by events; an op that cannot
be captured falls back to events around eager calls.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Sequence

import torch

Args = tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    samples: int
    method: str

    @property
    def spread_us(self) -> float:
        return self.p80_us - self.p20_us


def summarize(samples_us: Sequence[float], method: str) -> Timing:
    q = statistics.quantiles(samples_us, n=10, method="inclusive") if len(samples_us) > 1 else [
        samples_us[0]] * 9
    return Timing(statistics.median(samples_us), q[1], q[7], len(samples_us), method)


#: Student's t quantiles exceeded with probability ``alpha`` (one-sided), for 1 to 30 degrees of
#: freedom (computed with mpmath); more degrees use the value for 30, a little wider than exact.
_T_QUANTILES: dict[float, tuple[float, ...]] = {
    1e-4: (3183.099, 70.7, 22.204, 13.034, 9.678, 8.025, 7.063, 6.442, 6.01, 5.694, 5.453, 5.263,
           5.111, 4.985, 4.88, 4.791, 4.714, 4.648, 4.59, 4.539, 4.493, 4.452, 4.415, 4.382,
           4.352, 4.324, 4.299, 4.275, 4.254, 4.234),
    0.2: (1.376, 1.061, 0.978, 0.941, 0.92, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873,
          0.87, 0.868, 0.866, 0.865, 0.863, 0.862, 0.861, 0.86, 0.859, 0.858, 0.858, 0.857,
          0.856, 0.856, 0.855, 0.855, 0.854, 0.854),
}


@dataclasses.dataclass(frozen=True)
class RatioInterval:
    """One kernel's speedup over another from rounds timed side by side: the geometric mean of
    the rounds' ratios and its confidence interval ``lo``-``hi``. With fewer than 2 rounds there
    is no interval: both bounds are 0.0."""

    ratio: float
    lo: float
    hi: float
    rounds: int

    def above(self, threshold: float) -> bool:
        """The whole interval lies above ``threshold``."""
        return self.rounds >= 2 and self.lo > threshold

    def below(self, threshold: float) -> bool:
        """The whole interval lies below ``threshold``."""
        return self.rounds >= 2 and self.hi < threshold

    def bounds(self) -> tuple[float, float] | None:
        """The bounds as stored in a table row (``readable_bounds``); decisions use the raw ones."""
        return readable_bounds(self.lo, self.hi, self.rounds)

    def text(self) -> str:
        """The interval and its round count as printed (``interval_text``)."""
        return interval_text(self.lo, self.hi, self.rounds)


#: An interval whose bounds differ by more than this factor tells a reader nothing (two rounds
#: at ``ALPHA`` give bounds such as 0.000-7.5e+04): it is stored as none and shown as "not enough
#: rounds". Migration 0006 applies the same limit to rows stored before.
WIDEST = 10.0


def readable_bounds(lo: float | None, hi: float | None,
                    rounds: int | None) -> tuple[float, float] | None:
    """``(lo, hi)`` where they are worth storing and printing: from at least 2 rounds (``None``:
    not recorded, rows from before rounds were stored), finite, positive and at most ``WIDEST``
    apart; else ``None``."""
    if lo is None or hi is None or (rounds is not None and rounds < 2):
        return None
    if not (0.0 < lo <= hi < math.inf) or hi > WIDEST * lo:
        return None
    return lo, hi


def interval_text(lo: float | None, hi: float | None, rounds: int | None) -> str:
    """An interval as a person reads it, its round count beside it: ``1.021-1.130, 12 rounds``,
    or ``not enough rounds (2)`` where ``readable_bounds`` finds nothing to show."""
    bounds = readable_bounds(lo, hi, rounds)
    count = "rounds not recorded" if rounds is None else f"{rounds} rounds"
    if bounds is None:
        return f"not enough rounds ({rounds if rounds is not None else 'not recorded'})"
    return f"{bounds[0]:.3f}-{bounds[1]:.3f}, {count}"


def median_error(t: Timing) -> float:
    """The relative standard error of ``t``'s median that its own repetitions imply: their
    p20-p80 spread is 1.683 sigma for normal samples, and a median's error 1.2533 sigma /
    sqrt(n)."""
    return 0.745 * t.spread_us / math.sqrt(t.samples) / t.median_us if t.median_us else 0.0


def ratio_interval(ratios: Sequence[float], alpha: float, min_sd: float = 0.0) -> RatioInterval:
    """Student's t interval of the mean log ratio, each bound wrong with probability ``alpha``
    when the rounds' log ratios are independent and normal (rounds disturbed far beyond that are
    left out by the caller). The rounds' own spread sets the width, so a noisy machine needs a
    larger speedup, or more rounds, to show one; ``min_sd`` bounds that spread from below (what
    the timings' repetitions imply), so rounds that agree by chance prove no more than that.

    Raises:
        KeyError: ``alpha`` is not one of the tabulated levels (``_T_QUANTILES``).
    """
    table = _T_QUANTILES[alpha]
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    if n < 2:
        return RatioInterval(ratios[0] if ratios else 1.0, 0.0, 0.0, n)
    mean = statistics.fmean(logs)
    sd = max(statistics.stdev(logs), min_sd)
    half = table[min(n - 1, len(table)) - 1] * sd / math.sqrt(n)
    hi = math.exp(min(mean + half, 700.0))  # a few wild rounds: a huge bound, not an overflow
    return RatioInterval(math.exp(mean), math.exp(mean - half), hi, n)


#: Repetitions timed before a ``cutoff_us`` is checked.
PROBE_REPS = 3


def time_op(fn: Callable[..., torch.Tensor], inputs: Sequence[Args], device: str, *,
            warmup: int = 3, reps: int = 20, graph_calls: int = 10,
            cutoff_us: float | None = None) -> Timing:
    """Median time of one ``fn(*args)`` call, cycling through ``inputs``.

    Args:
        inputs: several argument sets; together larger than the last-level cache on GPUs.
        graph_calls: calls per captured CUDA graph replay (CUDA only).
        cutoff_us: stop after ``PROBE_REPS`` repetitions if their median is above this (a
            search candidate far slower than the best so far needs no precise time); the
            method then ends in ``-cut``.
    """
    if device.startswith("cuda"):
        try:
            return _time_cuda_graph(fn, inputs, warmup, reps, graph_calls, cutoff_us)
        except RuntimeError:  # capture not possible (host sync inside the op): time eagerly
            torch.cuda.synchronize()
            return _time_cuda_events(fn, inputs, warmup, reps, cutoff_us)
    return _time_cpu(fn, inputs, warmup, reps, cutoff_us)


def _repeat(sample: Callable[[int], list[float]], reps: int, cutoff_us: float | None,
            method: str) -> Timing:
    """``sample(n)`` times n repetitions; all ``reps`` unless the probe is above the cutoff."""
    if cutoff_us is None or reps <= PROBE_REPS:
        return summarize(sample(reps), method)
    probe = sample(PROBE_REPS)
    if statistics.median(probe) > cutoff_us:
        return summarize(probe, method + "-cut")
    return summarize(probe + sample(reps - PROBE_REPS), method)


def _time_cpu(fn: Callable[..., torch.Tensor], inputs: Sequence[Args], warmup: int,
              reps: int, cutoff_us: float | None) -> Timing:
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    done = 0

    def sample(n: int) -> list[float]:
        nonlocal done
        samples = []
        for _ in range(n):
            args = inputs[done % len(inputs)]
            done += 1
            start = time.perf_counter()
            fn(*args)
            samples.append((time.perf_counter() - start) * 1e6)
        return samples

    return _repeat(sample, reps, cutoff_us, "cpu-wall")


def _time_cuda_events(fn: Callable[..., torch.Tensor], inputs: Sequence[Args], warmup: int,
                      reps: int, cutoff_us: float | None) -> Timing:
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    done = 0

    def sample(n: int) -> list[float]:
        nonlocal done
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]
        for start, end in events:
            args = inputs[done % len(inputs)]
            done += 1
            start.record()
            fn(*args)
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in events]

    return _repeat(sample, reps, cutoff_us, "cuda-events")


def _time_cuda_graph(fn: Callable[..., torch.Tensor], inputs: Sequence[Args], warmup: int,
                     reps: int, graph_calls: int, cutoff_us: float | None) -> Timing:
    captured = inputs[:graph_calls]  # the graph replays these; warming the rest is wasted
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # eager warm-up compiles and fills allocator pools
        for i in range(max(warmup, len(captured))):
            fn(*captured[i % len(captured)])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(graph_calls):
            fn(*captured[i % len(captured)])
    for _ in range(warmup):
        graph.replay()

    def sample(n: int) -> list[float]:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 / graph_calls for s, e in events]

    return _repeat(sample, reps, cutoff_us, "cuda-graph")
