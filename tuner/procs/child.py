"""A spawned child process that answers requests over a pipe and is restarted after it dies.

Measuring and compiling both run candidates outside the tuner's process, so a candidate that
kills its process or corrupts the CUDA context (an illegal memory access poisons every later
call) costs one result, not the job. The protocol (``messages``): the child sends ``Ready``
once set up, then answers each request with one ``Reply``; it exits by itself after an
unhealthy one.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any, Callable

from moetune.tuner.procs.messages import Ready, Reply, Request


class Died(str):
    """How a child died instead of replying (a reply is never of this type)."""


class StartFailed(Died):
    """The child died setting up, before any request: the request itself is not to blame."""


class Child:
    """One child running ``target(conn, *args)``, started on first use and after a death."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], *,
                 timeout_s: float = 600.0) -> None:
        self.target, self.args, self.timeout = target, args, timeout_s
        self._ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self._proc: Any = None
        self._conn: Connection | None = None
        self._exit: int | None = None
        self.restarts = 0

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def call(self, request: Request) -> Reply | Died:
        """The child's reply to ``request``, or a ``Died`` saying how it died (it is killed)."""
        if not self.alive:
            died = self._start()
            if died:
                return died
        assert self._conn is not None
        try:
            self._conn.send(request)
            if self._conn.poll(self.timeout):
                reply: Reply = self._conn.recv()
                if not reply.healthy:  # the child exits by itself; wait so the next call restarts
                    self._proc.join(timeout=30)
                return reply
            why = f"timed out after {self.timeout:.0f}s"
        except (EOFError, OSError):
            why = "worker process died"
        self._kill()
        return Died(f"{why} (exit code {self._exit})")

    def close(self) -> None:
        if self._proc is not None:
            if self._conn is not None:
                self._conn.close()
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
            self._proc = self._conn = None

    def _start(self) -> StartFailed | None:
        if self._proc is not None:
            self.restarts += 1
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=self.target, args=(child, *self.args), daemon=True)
        try:
            self._proc.start()
        except (OSError, RuntimeError) as e:  # no process (limits, or spawned from a bootstrap)
            self._proc = None
            parent.close()
            return StartFailed(f"worker failed to start ({e})")
        finally:
            child.close()
        self._conn = parent
        try:
            if parent.poll(self.timeout) and isinstance(parent.recv(), Ready):
                return None
        except EOFError:
            pass
        self._kill()
        return StartFailed(f"worker failed to start (exit code {self._exit})")

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._exit = self._proc.exitcode


def context_healthy(device: str) -> bool:
    """False once the CUDA context is unusable (every later call on it would fail)."""
    if not device.startswith("cuda"):
        return True
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except RuntimeError:
        return False


def use_device(device: str) -> None:
    """Make ``device`` (``cuda:1``) the current GPU of this process: streams, CUDA graphs and
    Triton launches go to the current device, whatever device the tensors were made on."""
    if device.startswith("cuda:"):
        import torch

        torch.cuda.set_device(torch.device(device))
