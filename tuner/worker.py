"""Measuring in a child process, so a candidate that crashes the process or corrupts the CUDA
context (an illegal memory access poisons every later call) costs one result, not the job.

The child holds a ``Measurer``; after a failure on CUDA it checks the context with a
synchronize and, if that fails, exits so the parent starts a fresh child for the next candidate.
One child serves bucket after bucket (``switch``), so its compiled kernels stay warm.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import Registry
from moetune.tuner.inputs import Routing
from moetune.tuner.measure import Measurer, Result, Status
from moetune.tuner.timing import Timing


def _child(conn: Connection, problem: MoEProblem, device: str, paths: dict[str, str],
           routing: Routing, seed: int, reps: int) -> None:
    measurer = Measurer(problem, device, Registry(paths), routing=routing, seed=seed, reps=reps)
    conn.send("ready")
    while True:
        try:
            op, kernel, params, n = conn.recv()
        except EOFError:
            return
        if op == "problem":  # ``kernel`` carries the next problem
            measurer = Measurer(kernel, device, Registry(paths), routing=routing, seed=seed,
                                reps=reps)
            conn.send((None, True))
        elif op == "measure":
            result = measurer.measure(kernel, params)
            healthy = result.status is not Status.FAILED or _context_healthy(device)
            conn.send((result, healthy))
            if not healthy:
                return
        else:
            conn.send((measurer.retime(kernel, params, n), True))


def _context_healthy(device: str) -> bool:
    if not device.startswith("cuda"):
        return True
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except RuntimeError:
        return False


class IsolatedMeasurer:
    """The ``Measurer`` interface, run in a restartable child process (spawned, CUDA-safe)."""

    def __init__(self, problem: MoEProblem, device: str, registry: Registry, *,
                 routing: Routing = Routing.UNIFORM, seed: int = 0, reps: int = 20,
                 timeout_s: float = 600.0) -> None:
        self._args = (problem, device, registry.paths(), routing, seed, reps)
        self._timeout = timeout_s
        self._ctx = mp.get_context("spawn")
        self._proc: Any = None
        self._conn: Connection | None = None
        self._proc_exit: int | None = None
        self.restarts = 0

    def switch(self, problem: MoEProblem) -> None:
        """Measure ``problem`` from now on, in the same child when it is alive.

        Raises:
            RuntimeError: the child could not set the problem up (e.g. out of memory).
        """
        self._args = (problem, *self._args[1:])
        if self._proc is not None and self._proc.is_alive():
            reply = self._call("problem", problem, {}, 0)  # type: ignore[arg-type]
            if reply is not None:
                raise RuntimeError(f"setting up {problem.describe()} failed: {reply}")

    def measure(self, kernel: str, params: dict[str, Any]) -> Result:
        reply = self._call("measure", kernel, params, 0)
        if isinstance(reply, Result):
            return reply
        return Result(kernel, params, Status.FAILED, reason=reply)

    def retime(self, kernel: str, params: dict[str, Any], reps: int) -> Timing:
        reply = self._call("retime", kernel, params, reps)
        if isinstance(reply, Timing):
            return reply
        raise RuntimeError(f"re-timing {kernel} failed: {reply}")

    def close(self) -> None:
        if self._proc is not None:
            if self._conn is not None:
                self._conn.close()
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
            self._proc = self._conn = None

    def _call(self, op: str, kernel: Any, params: dict[str, Any], n: int) -> Any:
        """The child's reply, or a string saying how the child died."""
        if self._proc is None or not self._proc.is_alive():
            started = self._start()
            if started:
                return started
        assert self._conn is not None
        try:
            self._conn.send((op, kernel, params, n))
            if self._conn.poll(self._timeout):
                reply, healthy = self._conn.recv()
                if not healthy:  # the child exits by itself; wait so the next call restarts it
                    self._proc.join(timeout=30)
                return reply
            why = f"timed out after {self._timeout:.0f}s"
        except (EOFError, OSError, BrokenPipeError):
            why = "worker process died"
        self._kill()
        return f"{why} (exit code {self._proc_exit})"

    def _start(self) -> str | None:
        if self._proc is not None:
            self.restarts += 1
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_child, args=(child, *self._args), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        try:
            if parent.poll(self._timeout) and parent.recv() == "ready":
                return None
        except EOFError:
            pass
        self._kill()
        return f"worker failed to start (exit code {self._proc_exit})"

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._proc_exit = self._proc.exitcode
