"""A tuning job: every bucket of every shape, on one device or several (lanes), each bucket
published to the table as it finishes (``bucket``).

The job records one run in the table; each lane takes the next bucket when it is done with one,
with its own measuring child and compile pool kept across buckets, and the lanes' writes are
serialized. The run is marked failed if any bucket failed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import queue
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable

import optuna
from sqlalchemy.exc import SQLAlchemyError

from moetune import db
from moetune.errors import TuningError
from moetune.runtime.platform import SKU, Vendor, environment
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import Registry, default_registry
from moetune.tuner.bucket import BucketOptions, BucketOutcome, Lane, tune_bucket
from moetune.tuner.load import HostProbe, StreamProbe
from moetune.tuner.procs.compile_pool import CompilePool
from moetune.tuner.procs.measurer import IsolatedMeasurer
from moetune.tuner.roofline import Ceilings, measure_if_cuda

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class JobOptions(BucketOptions):
    """The buckets' options, and how the job spreads them over devices and processes."""

    #: Measure in a restartable child process (default on CUDA, where a bad kernel can
    #: poison the context for every later candidate).
    isolate: bool | None = None
    #: Children compiling JIT candidates ahead of timing, per device; None: half the cores (at
    #: most 8) shared by the devices, on CUDA, when each gets at least 2; none on CPU (nothing
    #: there compiles per config).
    compile_workers: int | None = None
    #: Tune buckets in parallel, one at a time on each of these devices (``cuda:0``, ``cuda:1``,
    #: ...); empty: on ``device`` alone.
    devices: tuple[str, ...] = ()

    @property
    def lanes(self) -> tuple[str, ...]:
        return self.devices or (self.device,)

    @property
    def isolated(self) -> bool:
        """Measure in child processes: by default on CUDA, and always on several devices
        (kernels are not all safe to run from two threads of one process; vLLM's CPU kernel
        is not)."""
        if self.devices:
            return True
        return self.device.startswith("cuda") if self.isolate is None else self.isolate

    @property
    def compilers(self) -> int:
        """Compile workers of each device."""
        if self.compile_workers is not None:
            return self.compile_workers
        workers = min(8, (os.cpu_count() or 2) // 2) // len(self.lanes)
        return workers if workers >= 2 and self.device.startswith("cuda") else 0  # 1 = serial


#: The folders of moetune's code in its checkout.
_PACKAGES = ("db", "runtime", "tuner")


def source_commit(checkout: Path = Path(__file__).parent) -> str | None:
    """The git commit moetune runs from, when it runs from a checkout; ``+modified`` when
    tracked files differ from it (a copied working tree whose ``.git`` lags behind) or the
    packages hold Python files git does not track (a kernel not committed yet), so a table
    never names a commit whose code it was not tuned with."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True,
                                 timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if not head:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no")
    added = git("ls-files", "--others", "--exclude-standard", "--",
                *(f":/{package}/*.py" for package in _PACKAGES))
    return head if changed == "" and added == "" else f"{head}+modified"


def _command_line() -> str:
    """The command that runs, as provenance: database URLs in it lose their passwords."""
    return " ".join(db.display_url(a) if db.is_url(a) else a for a in sys.argv)


def _check_storage(url: str | None) -> None:
    """Open the Optuna storage once before the job records its run, so a bad URL is one
    error line, not a failure in every bucket.

    Raises:
        TuningError: Optuna cannot open ``url``.
    """
    if url is None:
        return
    try:
        optuna.storages.get_storage(url)
    except (SQLAlchemyError, ValueError, ImportError, OSError) as e:
        raise TuningError(f"--optuna-storage {url}: cannot open it ({str(e).splitlines()[0]})"
                          ) from None


def run_job(problems: Iterable[MoEProblem], output: Path | str, sku: SKU, opts: JobOptions, *,
            registry: Registry = default_registry,
            on_bucket: Callable[[BucketOutcome], None] | None = None,
            on_trial: Callable[[], None] | None = None,
            measure_ceilings: Callable[[str], Ceilings | None] = measure_if_cuda,
            probe: HostProbe | None = None) -> list[BucketOutcome]:
    """Tune every problem (already bucketed) and write winners to ``output``.

    With several ``opts.devices`` each takes the next bucket when it is done with one; writes
    to ``output`` are serialized (they go through one ``db.TableWriter``). A bucket whose
    baseline fails is reported in its outcome and the job goes on; the run is marked failed if
    any bucket failed. The run records the device's ceilings, ``measure_ceilings(first
    device)`` (measured on CUDA, none on the CPU). On the CPU ``probe`` (default: a
    ``StreamProbe``) is read first here, at the job's start, and beside every confirmation
    round: without history it is each bucket's reference for load that lasts (``confirm``).
    """
    _check_storage(opts.optuna_storage)
    ceilings = _ceilings(measure_ceilings, opts.lanes[0])
    if sku.vendor is Vendor.CPU:
        probe = StreamProbe() if probe is None else probe
        probe()  # its fastest piece from a start before any of the job's own work
    else:  # host load does not slow a GPU's graph replays: a probe could only refuse wrongly
        probe = None
    writer = db.TableWriter(output)
    run_id = writer.start_run(sku.to_row(), environment=environment(), command=_command_line(),
                              commit=source_commit(),
                              driver=environment().get("cuda") or environment().get("hip"),
                              ceilings=ceilings)
    problems = list(problems)
    outcomes: list[BucketOutcome | None] = [None] * len(problems)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(problems)):
        todo.put(i)

    def lane(device: str) -> None:
        worker = IsolatedMeasurer(problems[0], device, registry, routing=opts.routing,
                                  seed=opts.seed, reps=opts.reps) if opts.isolated else None
        pool = CompilePool(problems[0], device, registry, workers=opts.compilers,
                           routing=opts.routing, seed=opts.seed) if opts.compilers else None
        try:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                outcome = tune_bucket(problems[i], writer, sku, opts, registry, run_id, on_trial,
                                      Lane(device if opts.devices else "", worker, pool, probe))
                outcomes[i] = outcome
                if on_bucket:
                    on_bucket(outcome)
        finally:
            for child in (worker, pool):
                if child is not None:
                    child.close()

    if problems:
        with concurrent.futures.ThreadPoolExecutor(len(opts.lanes)) as ex:
            for done in [ex.submit(lane, device) for device in opts.lanes]:
                done.result()
    finished = [o for o in outcomes if o is not None]
    status = db.RunStatus.FAILED if any(o.error for o in finished) else db.RunStatus.FINISHED
    writer.finish_run(run_id, status)
    return finished


def _ceilings(measure: Callable[[str], Ceilings | None], device: str) -> dict[str, float] | None:
    """The run's ceilings as stored; a failed measurement records none and the job goes on."""
    try:
        found = measure(device)
    except RuntimeError as e:
        logger.warning("moetune: the ceilings of %s were not measured (%s); reports of this "
                       "run draw no floors", device, e)
        return None
    return None if found is None else found.to_dict()
