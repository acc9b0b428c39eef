"""Compiling candidates ahead of timing, several at once, in child processes.

A Triton kernel compiles on its first launch with a new config (seconds: frontend, LLVM, ptxas)
while timing it takes milliseconds, so a serial search spends most of its time compiling. The
pool runs each new candidate once, at the bucket's exact shapes, in one of N children; Triton
writes the binaries to its on-disk cache, shared by every process of the user, and the measuring
process then loads them instead of compiling. Nothing is timed while the pool works, so the
children never disturb a timing.
"""

from __future__ import annotations

import concurrent.futures
import queue
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import Registry
from moetune.tuner.child import Child, StartFailed, context_healthy, use_device
from moetune.tuner.inputs import Routing, make_batch, make_weights
from moetune.tuner.measure import describe_exception

Candidate = tuple[str, dict[str, Any]]


def _serve(conn: Connection, problem: MoEProblem, device: str, paths: dict[str, str],
           routing: Routing, seed: int) -> None:
    registry = Registry(paths)

    def inputs_for(p: MoEProblem) -> tuple[Any, Any]:
        return make_weights(p, device, seed), make_batch(p, device, seed + 1, routing)

    use_device(device)
    weights, batch = inputs_for(problem)
    conn.send("ready")
    while True:
        try:
            op, arg = conn.recv()
        except EOFError:
            return
        if op == "problem":
            problem = arg
            weights, batch = inputs_for(problem)
            conn.send((None, True))
            continue
        kernel, params = arg
        try:
            registry.get(kernel).prepare(problem, params, weights)(*batch.args())
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            conn.send((None, True))
        except torch.OutOfMemoryError:  # the pool's own footprint, not the candidate's fault
            conn.send((None, True))
        except Exception as e:  # the candidate's failure: recorded, never raised
            healthy = context_healthy(device)
            conn.send((describe_exception(e), healthy))
            if not healthy:
                return


class CompilePool:
    """``workers`` children that each hold the bucket's weights and one batch, and run a
    candidate once when asked. Children start on first use and are restarted after a crash."""

    def __init__(self, problem: MoEProblem, device: str, registry: Registry, *, workers: int,
                 routing: Routing = Routing.UNIFORM, seed: int = 0,
                 timeout_s: float = 600.0) -> None:
        if workers < 1:
            raise ValueError(f"a compile pool needs at least one worker, got {workers}")
        self.workers = workers
        #: Wall seconds spent in ``compile`` so far (the job reports it per bucket).
        self.seconds = 0.0
        args = (problem, device, registry.paths(), routing, seed)
        self._children = [Child(_serve, args, timeout_s=timeout_s) for _ in range(workers)]

    def switch(self, problem: MoEProblem) -> None:
        """Compile for ``problem`` from now on (running children rebuild their inputs)."""
        for child in self._children:
            child.args = (problem, *child.args[1:])
        running = [c for c in self._children if c.alive]
        with concurrent.futures.ThreadPoolExecutor(max(len(running), 1)) as ex:
            replies = list(ex.map(lambda c: c.call(("problem", problem)), running))
        for child, reply in zip(running, replies):
            if reply is not None:  # it died setting up: the next call starts it afresh
                child.close()

    def compile(self, candidates: list[Candidate]) -> list[str | None]:
        """Run each candidate once, ``workers`` at a time.

        Returns:
            Per candidate, why it failed (an error, a crash, a timeout), or None if it ran or
            the pool could not run it (no memory, a worker that cannot start): the measurer
            then compiles it as usual.
        """
        free: queue.SimpleQueue[Child] = queue.SimpleQueue()
        for child in self._children:
            free.put(child)

        def run(candidate: Candidate) -> str | None:
            child = free.get()
            try:
                reply = child.call(("compile", candidate))
            finally:
                free.put(child)
            return None if reply is None or isinstance(reply, StartFailed) else str(reply)

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(self.workers) as ex:
            failures = list(ex.map(run, candidates))
        self.seconds += time.perf_counter() - start
        return failures

    def close(self) -> None:
        for child in self._children:
            child.close()
