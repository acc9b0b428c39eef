"""Measuring in a restartable child process (see ``child``).

The child holds a ``Measurer``; after a failure on CUDA it checks the context with a
synchronize and, if that fails, exits so the parent starts a fresh child for the next candidate.
One child serves bucket after bucket (``switch``), so its compiled kernels stay warm.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from moetune.errors import WorkerDiedError
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import Registry
from moetune.tuner.inputs import Routing
from moetune.tuner.measure import Measurer, Result, Status
from moetune.tuner.procs.child import Child, Died, context_healthy, use_device
from moetune.tuner.procs.messages import Measure, Measured, Ready, Retime, Retimed, UseProblem
from moetune.tuner.timing import Timing


def _serve(conn: Connection, problem: MoEProblem, device: str, paths: dict[str, str],
           routing: Routing, seed: int, reps: int) -> None:
    def measurer_for(p: MoEProblem) -> Measurer:
        return Measurer(p, device, Registry(paths), routing=routing, seed=seed, reps=reps)

    use_device(device)
    measurer = measurer_for(problem)
    conn.send(Ready())
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        match request:
            case UseProblem():
                measurer = measurer_for(request.problem)
                conn.send(Ready())
            case Measure():
                result = measurer.measure(request.kernel, request.params, request.cutoff_us)
                healthy = result.status is not Status.FAILED or context_healthy(device)
                conn.send(Measured(result, healthy=healthy))
                if not healthy:
                    return
            case Retime():
                conn.send(Retimed(measurer.retime(request.kernel, request.params, request.reps)))


class IsolatedMeasurer:
    """The ``Measurer`` interface, run in a restartable child process (spawned, CUDA-safe)."""

    def __init__(self, problem: MoEProblem, device: str, registry: Registry, *,
                 routing: Routing = Routing.UNIFORM, seed: int = 0, reps: int = 20,
                 timeout_s: float = 600.0) -> None:
        self._child = Child(_serve, (problem, device, registry.paths(), routing, seed, reps),
                            timeout_s=timeout_s)

    @property
    def restarts(self) -> int:
        return self._child.restarts

    def switch(self, problem: MoEProblem) -> None:
        """Measure ``problem`` from now on, in the same child when it is alive.

        Raises:
            WorkerDiedError: the child could not set the problem up (e.g. out of memory).
        """
        self._child.args = (problem, *self._child.args[1:])
        if self._child.alive:
            reply = self._child.call(UseProblem(problem))
            if isinstance(reply, Died):
                raise WorkerDiedError(f"setting up {problem.describe()} failed: {reply}")

    def measure(self, kernel: str, params: dict[str, Any],
                cutoff_us: float | None = None) -> Result:
        reply = self._child.call(Measure(kernel, params, cutoff_us))
        if isinstance(reply, Died):
            return Result(kernel, params, Status.FAILED, reason=str(reply))
        assert isinstance(reply, Measured)
        return reply.result

    def retime(self, kernel: str, params: dict[str, Any], reps: int) -> Timing:
        """Raises: WorkerDiedError: the child died or timed out re-timing ``kernel``."""
        reply = self._child.call(Retime(kernel, params, reps))
        if isinstance(reply, Died):
            raise WorkerDiedError(f"re-timing {kernel} failed: {reply}")
        assert isinstance(reply, Retimed)
        return reply.timing

    def close(self) -> None:
        self._child.close()
