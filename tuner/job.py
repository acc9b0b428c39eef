"""A tuning job: every bucket of every shape, each bucket published to the table as it finishes.

Each bucket is written through ``write_table`` (copy, write, atomic replace), so a killed job
leaves a valid table with the buckets it finished, and a rerun skips what it already measured.
Several jobs may tune into one table (file or server): each claims a bucket while tuning it and
skips one another job holds; a bucket another job finished is re-confirmed from its
measurements, which keep the provenance of the run that made them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from moetune import db
from moetune.errors import TuningError
from moetune.runtime.kernels.base import params_key
from moetune.runtime.platform import SKU, environment
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import Registry, default_registry
from moetune.runtime.dispatcher import row_verdict
from moetune.tuner.inputs import Routing
from moetune.tuner.measure import Measurer, Result
from moetune.tuner.precompile import CompilePool
from moetune.tuner.roofline import Ceilings, measure_if_cuda
from moetune.tuner.study import Decision, Key, confirm, search
from moetune.tuner.timing import Timing
from moetune.tuner.worker import IsolatedMeasurer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class JobOptions:
    device: str = "cpu"
    trials: int = 24
    seed: int = 0
    routing: Routing = Routing.UNIFORM
    reps: int = 20
    optuna_storage: str | None = None
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
    #: Leave alone buckets the table already has a measured winner for, timed against the rule
    #: as it is now (a resumed job, or hosts that start after others finished some buckets).
    skip_tuned: bool = False

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


@dataclasses.dataclass(frozen=True)
class BucketOutcome:
    problem: MoEProblem
    decision: Decision | None
    measured: int
    reused: int
    error: str | None = None
    #: The device that tuned it, when the job ran on several.
    device: str = ""
    #: Why the bucket was left alone (another job on the same database was tuning it).
    skipped: str | None = None
    #: Wall seconds of the bucket by phase: ``setup`` (inputs in the workers), ``compile_ahead``,
    #: ``first_calls`` (prepare + gate), ``timing``, ``confirm``, and ``total``.
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)


def source_commit() -> str | None:
    """The git commit moetune runs from, when it runs from a checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _command_line() -> str:
    """The command that runs, as provenance: database URLs in it lose their passwords."""
    return " ".join(db.display_url(a) if db.is_url(a) else a for a in sys.argv)


def _sku_row(session: object, sku: SKU) -> db.SkuRow:
    return db.get_or_create_sku(session, **sku.to_row())


def run_job(problems: Iterable[MoEProblem], output: Path | str, sku: SKU, opts: JobOptions, *,
            registry: Registry = default_registry,
            on_bucket: Callable[[BucketOutcome], None] | None = None,
            on_trial: Callable[[], None] | None = None,
            measure_ceilings: Callable[[str], Ceilings | None] = measure_if_cuda,
            ) -> list[BucketOutcome]:
    """Tune every problem (already bucketed) and write winners to ``output``.

    With several ``opts.devices`` each takes the next bucket when it is done with one; writes
    to ``output`` are serialized. A bucket whose baseline fails is reported in its outcome and
    the job goes on; the run is marked failed if any bucket failed. The run records the
    device's ceilings, ``measure_ceilings(first device)`` (measured on CUDA, none on the CPU).
    """
    ceilings = _ceilings(measure_ceilings, opts.lanes[0])
    with db.write_table(output) as table, table.session() as s:
        run_id = db.start_run(s, _sku_row(s, sku), environment=environment(),
                              command=_command_line(), commit=source_commit(),
                              driver=environment().get("cuda") or environment().get("hip"),
                              ceilings=ceilings).id
    problems = list(problems)
    outcomes: list[BucketOutcome | None] = [None] * len(problems)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(problems)):
        todo.put(i)
    writing = threading.Lock()

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
                outcome = _tune_bucket(problems[i], output, sku, opts, registry, run_id, on_trial,
                                       _Lane(device if opts.devices else "", worker, pool, writing))
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
    with db.write_table(output) as table, table.session() as s:
        db.finish_run(s, db.get_run(s, run_id), status)
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


@dataclasses.dataclass(frozen=True)
class _Lane:
    """Where a bucket is tuned: the device (named when the job has several), its measuring
    child and compile pool (reused across buckets), and the lock that serializes writes."""

    device: str
    worker: IsolatedMeasurer | None
    pool: CompilePool | None
    writing: threading.Lock


def claim_bucket(output: Path | str, sku: SKU,
                 problem: MoEProblem) -> contextlib.AbstractContextManager[bool]:
    """The claim a job holds on ``problem``'s bucket of ``sku`` in ``output`` while tuning it:
    jobs given the same buckets of one table (a file, or a database several hosts share) share
    them out this way."""
    name = f"moetune bucket {sku.vendor.value}:{sku.name}:{sku.arch} {problem.describe()}"
    return db.claim_in(output, name)


def _tune_bucket(problem: MoEProblem, output: Path | str, sku: SKU, opts: JobOptions,
                 registry: Registry, run_id: int, on_trial: Callable[[], None] | None,
                 lane: _Lane) -> BucketOutcome:
    with claim_bucket(output, sku, problem) as mine:
        if not mine:
            return BucketOutcome(problem, None, 0, 0, device=lane.device,
                                 skipped="another job is tuning it")
        done = _current_winner(output, sku, problem) if opts.skip_tuned else None
        if done is not None:
            return BucketOutcome(problem, None, 0, 0, device=lane.device,
                                 skipped=f"already tuned (run {done.run_id}: {done.kernel})")
        return _tune_claimed(problem, output, sku, opts, registry, run_id, on_trial, lane)


def _current_winner(output: Path | str, sku: SKU, problem: MoEProblem) -> db.WinnerRecord | None:
    """The table's measured winner for ``problem`` on ``sku`` if serving would use it here
    (today's rule is among the baselines it was timed against), else None."""
    if not db.is_url(output) and not Path(output).exists():
        return None
    for row in db.read_winners(output).rows:
        if row.source != "measured":
            continue
        verdict = row_verdict(row, sku)
        if verdict.problem == problem and verdict.selection is not None:
            return row
    return None


def _tune_claimed(problem: MoEProblem, output: Path | str, sku: SKU, opts: JobOptions,
                  registry: Registry, run_id: int, on_trial: Callable[[], None] | None,
                  lane: _Lane) -> BucketOutcome:
    candidates = registry.candidates(problem, sku)
    worker, pool = lane.worker, lane.pool
    known, measured_by = _known_results(output, sku, problem)
    start = time.perf_counter()
    compiled_before = pool.seconds if pool else 0.0
    try:
        if worker:
            worker.switch(problem)
        if pool:
            pool.switch(problem)
        measurer = worker or Measurer(problem, lane.device or opts.device, registry,
                                      routing=opts.routing, seed=opts.seed, reps=opts.reps)
        searching = time.perf_counter()
        results = search(problem, sku, measurer, candidates, trials=opts.trials, seed=opts.seed,
                         known=known, storage=opts.optuna_storage, compiler=pool,
                         progress=on_trial)
        confirming = time.perf_counter()
        decision = confirm(problem, sku, measurer, results)
    except (TuningError, RuntimeError) as e:
        return BucketOutcome(problem, None, 0, len(known), str(e), device=lane.device)
    fresh = [r for k, r in results.items() if k not in known]
    end = time.perf_counter()
    seconds = {"setup": searching - start,
               "compile_ahead": (pool.seconds if pool else 0.0) - compiled_before,
               "first_calls": sum(r.first_call_s for r in fresh),
               "timing": sum(r.timing_s for r in fresh),
               "confirm": end - confirming, "total": end - start}
    w, wt, bt = decision.winner, decision.winner_timing, decision.baseline_timing
    with lane.writing, db.write_table(output) as table, table.session() as s:
        run = db.get_run(s, run_id)
        bucket = db.get_or_create_bucket(s, **problem.to_row())
        for r in fresh:
            t = r.timing
            db.add_measurement(s, run, bucket, r.kernel, r.params,
                               t.median_us if t else None, t.p20_us if t else None,
                               t.p80_us if t else None, t.samples if t else 0, r.error,
                               r.status, r.reason)
        found_by = db.get_run(s, measured_by.get((w.kernel, params_key(w.params)), run_id))
        db.set_winner(s, _sku_row(s, sku), bucket, found_by, w.kernel, w.params, wt.median_us,
                      wt.p20_us, wt.p80_us, w.error, decision.baseline.kernel,
                      decision.baseline.params, bt.median_us,
                      baselines=[b.to_row() for b in decision.baselines])
    return BucketOutcome(problem, decision, len(fresh), len(known), seconds=seconds,
                         device=lane.device)


def _known_results(output: Path | str, sku: SKU,
                   problem: MoEProblem) -> tuple[dict[Key, Result], dict[Key, int]]:
    """Measurements earlier runs (this job's included) left in ``output`` for this bucket, and
    the run that made each. Read-only: another job may be replacing the file meanwhile."""
    if not db.is_url(output) and not Path(output).exists():
        return {}, {}
    with db.open_table(output) as table, table.session() as s:
        sku_row = db.find_sku(s, vendor=sku.vendor.value, name=sku.name, arch=sku.arch,
                              compute_units=sku.compute_units)
        bucket = db.find_bucket(s, **problem.to_row())
        rows = db.measured(s, sku_row, bucket) if sku_row and bucket else {}
        known, runs = {}, {}
        for (kernel, pkey), m in rows.items():
            timing = None
            if m.median_us is not None:
                timing = Timing(m.median_us, m.p20_us, m.p80_us, m.samples, "stored")
            known[(kernel, pkey)] = Result(kernel, db.load_json(m.params), m.status,
                                           timing, m.error, m.reason)
            runs[(kernel, pkey)] = m.run_id
        return known, runs
