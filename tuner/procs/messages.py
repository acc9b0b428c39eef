"""The messages between the tuner and its child processes, one frozen dataclass per kind, so
each side matches a request or reply by its type, never by a tuple's position.

A child sends ``Ready`` once set up, then answers each request with one reply; a reply that is
not ``healthy`` is its last (its CUDA context is unusable, so it exits and is restarted).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moetune.runtime.problem import MoEProblem
from moetune.tuner.measure import Result
from moetune.tuner.timing import Timing


@dataclasses.dataclass(frozen=True)
class UseProblem:
    """Hold ``problem``'s inputs from now on (the child answers ``Ready``)."""

    problem: MoEProblem


@dataclasses.dataclass(frozen=True)
class Measure:
    """Gate and time a candidate, cut short above ``cutoff_us`` (``Measurer.measure``)."""

    kernel: str
    params: dict[str, Any]
    cutoff_us: float | None = None


@dataclasses.dataclass(frozen=True)
class Retime:
    """Time a measured candidate again over ``reps`` repetitions (``Measurer.retime``)."""

    kernel: str
    params: dict[str, Any]
    reps: int


@dataclasses.dataclass(frozen=True)
class Compile:
    """Run a candidate once on the compile inputs, so its JIT binaries land in the cache."""

    kernel: str
    params: dict[str, Any]


Request = UseProblem | Measure | Retime | Compile


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reply:
    """What a child answers; not ``healthy``: the child exits after sending it."""

    healthy: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ready(Reply):
    """The child holds its problem's inputs and takes requests."""


@dataclasses.dataclass(frozen=True)
class Measured(Reply):
    result: Result


@dataclasses.dataclass(frozen=True)
class Retimed(Reply):
    timing: Timing


@dataclasses.dataclass(frozen=True)
class Compiled(Reply):
    """The candidate ran (``failure`` None), failed (why), or ran out of memory: the pool's
    footprint, not the candidate's fault."""

    failure: str | None = None
    out_of_memory: bool = False
