"""Compiling candidates ahead of timing, several at once, in child processes.

A Triton kernel compiles on its first launch with a new config (seconds: frontend, LLVM, ptxas)
while timing it takes milliseconds, so a serial search spends most of its time compiling. The
pool runs each new candidate once, at the bucket's exact shapes, in one of N children; Triton
writes the binaries to its on-disk cache, shared by every process of the user, and the measuring
process then loads them instead of compiling. Nothing is timed while the pool works, so the
children never disturb a timing.

A child needs no real weights for that: Triton keys a binary on dtypes, constexprs and each
integer argument's divisibility by 16, never on the data or on how many experts there are. It
holds one expert's weights presented as all of them (a stride-0 expert dimension: every expert
strides 0, divisible by 16 like the real N*K) beside full-size scales (small) and the bucket's
real batch, so a DeepSeek-V3 shard's child holds megabytes instead of 1.4 GB. The pool is sized
to the memory free on the GPU and the host, and shrinks when a compile runs out of memory.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from moetune.runtime.kernels.base import MoEWeights
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import Registry
from moetune.tuner.inputs import Batch, Routing, make_batch, make_weights
from moetune.tuner.measure import describe_exception
from moetune.tuner.procs.child import Child, Died, StartFailed, context_healthy, use_device
from moetune.tuner.procs.messages import Compile, Compiled, Ready, UseProblem

logger = logging.getLogger("moetune")

Candidate = tuple[str, dict[str, Any]]
#: What a compile child holds besides its inputs, estimated: on the GPU a CUDA context and
#: Triton's working memory; on the host torch, Triton and the CUDA libraries.
CHILD_GPU_BYTES = 1 << 30
CHILD_HOST_BYTES = 3 << 29


def compile_inputs(problem: MoEProblem, device: str, seed: int,
                   routing: Routing) -> tuple[MoEWeights, Batch]:
    """Inputs that launch a candidate exactly as the measurer's do, at a fraction of the
    memory: one expert's weights as every expert's (stride 0), full scales, the real batch."""
    one = make_weights(dataclasses.replace(problem, num_experts=1, topk=1), device, seed)
    e = problem.num_experts
    weights = MoEWeights(one.w13.expand(e, *one.w13.shape[1:]),
                         one.w2.expand(e, *one.w2.shape[1:]), problem.quant,
                         *(None if t is None else t.expand(e, *t.shape[1:]).contiguous()
                           for t in (one.w13_scale, one.w2_scale)))
    return weights, make_batch(problem, device, seed + 1, routing)


def held_bytes(weights: MoEWeights, batch: Batch) -> int:
    """Bytes of storage behind ``weights`` and ``batch`` (shared storage counted once)."""
    tensors = [t for t in (weights.w13, weights.w2, weights.w13_scale, weights.w2_scale)
               if t is not None] + list(batch.args())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def fitting_workers(requested: int, problem: MoEProblem, device: str) -> int:
    """At most ``requested`` compile children, as many as the free GPU and host memory hold
    (at least one: the pool then compiles serially, and the measurer after an OOM)."""
    per_child = _work_bytes(problem)
    fits = requested
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        fits = min(fits, int(0.8 * free) // (CHILD_GPU_BYTES + per_child))
    available = _host_available()
    if available is not None:
        fits = min(fits, int(0.8 * available) // CHILD_HOST_BYTES)
    if fits < requested:
        logger.warning("moetune: %d compile workers instead of %d: that is what the free memory "
                       "holds", max(fits, 1), requested)
    return max(fits, 1)


def _work_bytes(problem: MoEProblem) -> int:
    """A child's inputs and the kernels' intermediates at the bucket's size, roughly."""
    m, k = problem.num_tokens, problem.topk
    h, i = problem.hidden_size, problem.intermediate_size
    element = torch.finfo(getattr(torch, problem.dtype.value)).bits // 8
    weights = (3 if problem.gated else 2) * h * i * element
    return weights + m * k * (2 * i + i + h) * 4 + m * h * element * 2


def _host_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _serve(conn: Connection, problem: MoEProblem, device: str, paths: dict[str, str],
           routing: Routing, seed: int) -> None:
    registry = Registry(paths)

    def inputs_for(p: MoEProblem) -> tuple[MoEWeights, Batch]:
        return compile_inputs(p, device, seed, routing)

    use_device(device)
    weights, batch = inputs_for(problem)
    conn.send(Ready())
    while True:
        try:
            request: UseProblem | Compile = conn.recv()
        except EOFError:
            return
        if isinstance(request, UseProblem):
            problem = request.problem
            weights, batch = inputs_for(problem)
            conn.send(Ready())
            continue
        try:
            registry.get(request.kernel).prepare(problem, request.params, weights)(*batch.args())
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            conn.send(Compiled())
        except torch.OutOfMemoryError:  # retried with fewer children, finally by the measurer
            conn.send(Compiled(out_of_memory=True))
        except Exception as e:  # the candidate's failure: recorded, never raised
            healthy = context_healthy(device)
            conn.send(Compiled(describe_exception(e), healthy=healthy))
            if not healthy:
                return


class CompilePool:
    """``workers`` children that each hold the bucket's ``compile_inputs`` and run a candidate
    once when asked. Children start on first use and are restarted after a crash."""

    def __init__(self, problem: MoEProblem, device: str, registry: Registry, *, workers: int,
                 routing: Routing = Routing.UNIFORM, seed: int = 0,
                 timeout_s: float = 600.0) -> None:
        if workers < 1:
            raise ValueError(f"a compile pool needs at least one worker, got {workers}")
        self.workers = workers = fitting_workers(workers, problem, device)
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
            replies = list(ex.map(lambda c: c.call(UseProblem(problem)), running))
        for child, reply in zip(running, replies):
            if isinstance(reply, Died):  # it died setting up: the next call starts it afresh
                child.close()

    def compile(self, candidates: list[Candidate]) -> list[str | None]:
        """Run each candidate once, ``workers`` at a time; those that ran out of memory again
        with half the children, down to one.

        Returns:
            Per candidate, why it failed (an error, a crash, a timeout), or None if it ran or
            the pool could not run it (no memory with one child, a worker that cannot start):
            the measurer then compiles it as usual.
        """
        start = time.perf_counter()
        failures: list[str | None] = [None] * len(candidates)
        todo = list(range(len(candidates)))
        while todo:
            replies = self._run([candidates[i] for i in todo])
            for i, reply in zip(todo, replies):
                failures[i] = reply.failure
            todo = [i for i, reply in zip(todo, replies) if reply.out_of_memory]
            if todo and self.workers == 1:
                break
            if todo:
                self._shrink()
        self.seconds += time.perf_counter() - start
        return failures

    def _run(self, candidates: list[Candidate]) -> list[Compiled]:
        free: queue.SimpleQueue[Child] = queue.SimpleQueue()
        for child in self._children:
            free.put(child)

        def run(candidate: Candidate) -> Compiled:
            child = free.get()
            try:
                reply = child.call(Compile(*candidate))
            finally:
                free.put(child)
            if isinstance(reply, StartFailed):  # not the candidate's fault: left to the measurer
                return Compiled()
            if isinstance(reply, Died):
                return Compiled(str(reply))
            assert isinstance(reply, Compiled)
            return reply

        with concurrent.futures.ThreadPoolExecutor(self.workers) as ex:
            return list(ex.map(run, candidates))

    def _shrink(self) -> None:
        """Close half the children (their memory goes back to the others)."""
        keep = max(1, self.workers // 2)
        for child in self._children[keep:]:
            child.close()
        logger.warning("moetune: compile workers ran out of memory; %d instead of %d from now on",
                       keep, self.workers)
        self._children, self.workers = self._children[:keep], keep

    def close(self) -> None:
        for child in self._children:
            child.close()
