"""Measuring one candidate: prepare it, gate it against the reference, time it."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Protocol

from moetune import db
from moetune.runtime.kernels.base import MoEFn, params_key
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import Registry
from moetune.tuner.gate import poisoned_allocations, relative_error, tolerance
from moetune.tuner.inputs import Routing, make_batch, make_weights
from moetune.tuner.timing import Timing, time_op

# Timing inputs together exceed this many bytes on GPUs, so activations are not L2-hot.
_ROTATE_BYTES = 256 << 20


#: Outcome of one measurement: the table's own enum, so a result is stored as it is.
Status = db.MeasurementStatus
#: A candidate as results are keyed: ``(kernel, params_key(params))``.
Key = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class Result:
    kernel: str
    params: dict[str, Any]
    status: Status
    timing: Timing | None = None
    error: float | None = None
    reason: str | None = None
    #: Seconds spent preparing and gating (the first call: a JIT kernel compiles there unless
    #: compiled ahead), and timing; zero for results not measured here.
    first_call_s: float = 0.0
    timing_s: float = 0.0

    @property
    def median_us(self) -> float:
        return self.timing.median_us if self.timing else math.inf


def describe_exception(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:500]


class CandidateMeasurer(Protocol):
    """What the search needs: gate-and-time a candidate, and re-time one for confirmation."""

    def measure(self, kernel: str, params: dict[str, Any],
                cutoff_us: float | None = None) -> Result: ...

    def retime(self, kernel: str, params: dict[str, Any], reps: int) -> Timing: ...


class Measurer:
    """Times candidates for one problem in this process, on shared weights and inputs.

    Holds one set of weights, a check batch with its float32 reference output, and rotating
    timing batches; prepared callables are kept for the confirmation round.
    """

    def __init__(self, problem: MoEProblem, device: str, registry: Registry, *,
                 routing: Routing = Routing.UNIFORM, seed: int = 0, reps: int = 20) -> None:
        self.problem, self.device, self.registry, self.reps = problem, device, registry, reps
        self.weights = make_weights(problem, device, seed)
        self.check = make_batch(problem, device, seed + 1, routing)
        self.reference = registry.get("reference").prepare(problem, {}, self.weights)(
            *self.check.args())
        sets = 2
        if device.startswith("cuda"):
            sets = max(2, min(32, math.ceil(_ROTATE_BYTES / max(self.check.nbytes(), 1))))
        self.inputs = [make_batch(problem, device, seed + 2 + i, routing).args()
                       for i in range(sets)]
        self._prepared: dict[tuple[str, str], MoEFn] = {}

    def measure(self, kernel: str, params: dict[str, Any],
                cutoff_us: float | None = None) -> Result:
        """Gate then time one candidate. Failures are results, never exceptions.

        ``cutoff_us``: stop timing early if the candidate is slower than this (see ``time_op``).
        """
        start = time.perf_counter()
        try:
            fn = self._prepare(kernel, params)
            with poisoned_allocations(self.device, self.reference.numel() * 4 * 4):
                out = fn(*self.check.args())
            error = relative_error(out, self.reference)
        except Exception as e:  # a candidate that raises is a recorded failure, not a crash
            return Result(kernel, params, Status.FAILED, reason=describe_exception(e),
                          first_call_s=time.perf_counter() - start)
        first = time.perf_counter() - start
        allowed = tolerance(self.problem, self.device)
        if not error <= allowed:
            return Result(kernel, params, Status.WRONG, error=error,
                          reason=f"relative error {error:.3g} > {allowed:.3g}", first_call_s=first)
        try:
            timing = time_op(fn, self.inputs, self.device, reps=self.reps, cutoff_us=cutoff_us)
        except Exception as e:
            return Result(kernel, params, Status.FAILED, error=error,
                          reason=describe_exception(e), first_call_s=first,
                          timing_s=time.perf_counter() - start - first)
        cut = f"timing cut after {timing.samples} reps: above {cutoff_us:.1f}us" \
            if timing.method.endswith("-cut") else None
        return Result(kernel, params, Status.OK, timing, error, cut, first_call_s=first,
                      timing_s=time.perf_counter() - start - first)

    def retime(self, kernel: str, params: dict[str, Any], reps: int) -> Timing:
        """Time an already-measured candidate again (used interleaved by the confirmation round)."""
        return time_op(self._prepare(kernel, params), self.inputs, self.device, reps=reps)

    def _prepare(self, kernel: str, params: dict[str, Any]) -> MoEFn:
        key = (kernel, params_key(params))
        if key not in self._prepared:
            self._prepared[key] = self.registry.get(kernel).prepare(
                self.problem, params, self.weights)
        return self._prepared[key]
