"""One bucket of a job: claim it, reuse what the table already measured, tune it (or, with
``reconfirm``, re-time the table's winner against the rule), publish it.

A bucket is claimed while it is tuned, so jobs given the same buckets of one table (a file, or
a database several hosts share) share them out; a bucket another job finished is re-confirmed
from its measurements, which keep the provenance of the run that made them. The bucket's new
measurements and its winner are published in one write, so a killed job leaves the buckets it
finished and a rerun skips what it already measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterable

from moetune import db
from moetune.errors import InvalidParamsError, TuningError, UnknownKernelError
from moetune.runtime.dispatcher import row_point, row_verdict
from moetune.runtime.kernels.base import params_key
from moetune.runtime.platform import SKU, environment, environment_mismatches
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import Registry
from moetune.runtime.rules import rule_choice
from moetune.tuner.confirm import Decision, confirm
from moetune.tuner.inputs import Routing
from moetune.tuner.load import HostProbe
from moetune.tuner.measure import Key, Measurer, Result, Status
from moetune.tuner.procs.compile_pool import CompilePool
from moetune.tuner.procs.measurer import IsolatedMeasurer
from moetune.tuner.search import REFINE, TRIALS, remeasure, search
from moetune.tuner.timing import Timing


@dataclasses.dataclass(frozen=True)
class BucketOptions:
    """How each bucket is searched and measured."""

    device: str = "cpu"
    trials: int = TRIALS
    #: Evaluations of the local search after the trials (``search``).
    refine: int = REFINE
    seed: int = 0
    routing: Routing = Routing.UNIFORM
    reps: int = 20
    optuna_storage: str | None = None
    #: Leave alone buckets the table already has a measured winner for, timed against the rule
    #: as it is now (a resumed job, or hosts that start after others finished some buckets).
    skip_tuned: bool = False
    #: Where the table has a winner for the bucket on this SKU (from any run, under any
    #: versions), measure only it and the rule variants and confirm again, instead of
    #: searching: adopting a table timed under other torch/Triton/CUDA versions then costs
    #: seconds per bucket. Buckets without one are searched.
    reconfirm: bool = False
    #: Only candidates whose bits are the same in every call (``BaseKernel.run_to_run``), for
    #: serving under ``MOETUNE_DETERMINISTIC=1``: a winner of the table that varies is neither
    #: kept (``skip_tuned``) nor re-confirmed, and its stored times are no candidates.
    deterministic: bool = False


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
    #: The run whose winner was re-timed instead of searching (``reconfirm``).
    reconfirmed: int | None = None


@dataclasses.dataclass(frozen=True)
class Lane:
    """Where a bucket is tuned: the device (named when the job has several), its measuring
    child and compile pool (reused across buckets), and the job's host probe (``confirm``)."""

    device: str
    worker: IsolatedMeasurer | None
    pool: CompilePool | None
    probe: HostProbe | None = None


def claim_bucket(writer: db.TableWriter, sku: SKU,
                 problem: MoEProblem) -> contextlib.AbstractContextManager[bool]:
    """The claim a job holds on ``problem``'s bucket of ``sku`` in the writer's table while
    tuning it: jobs given the same buckets of one table (a file, or a database several hosts
    share) share them out this way."""
    return writer.claim(f"moetune bucket {sku.vendor.value}:{sku.name}:{sku.arch} "
                        f"{problem.describe()}")


def tune_bucket(problem: MoEProblem, writer: db.TableWriter, sku: SKU, opts: BucketOptions,
                registry: Registry, run_id: int, on_trial: Callable[[], None] | None,
                lane: Lane) -> BucketOutcome:
    """Tune ``problem`` into the writer's table as part of run ``run_id``, unless another job
    holds its claim or (``opts.skip_tuned``) the table already has a winner serving would use."""
    with claim_bucket(writer, sku, problem) as mine:
        if not mine:
            return BucketOutcome(problem, None, 0, 0, device=lane.device,
                                 skipped="another job is tuning it")
        done = _current_winner(writer, sku, problem) if opts.skip_tuned else None
        if done is not None and opts.deterministic and _varies(done, problem, registry):
            done = None
        if done is not None:
            return BucketOutcome(problem, None, 0, 0, device=lane.device,
                                 skipped=f"already tuned (run {done.run_id}: {done.kernel})")
        return _tune_claimed(problem, writer, sku, opts, registry, run_id, on_trial, lane)


def _current_winner(writer: db.TableWriter, sku: SKU,
                    problem: MoEProblem) -> db.WinnerRecord | None:
    """The table's measured winner for ``problem`` on ``sku`` if serving would use it here
    (today's rule is among the baselines it was timed against, under today's versions), else
    None."""
    for row in writer.winners():
        if row.source != "measured":
            continue
        verdict = row_verdict(row, sku, environment=environment())
        if verdict.problem == problem and verdict.selection is not None:
            return row
    return None


def _tune_claimed(problem: MoEProblem, writer: db.TableWriter, sku: SKU, opts: BucketOptions,
                  registry: Registry, run_id: int, on_trial: Callable[[], None] | None,
                  lane: Lane) -> BucketOutcome:
    candidates = registry.candidates(problem, sku)
    worker, pool = lane.worker, lane.pool
    rows = writer.winners()
    again = _table_winner(rows, sku, problem, registry,
                          {k.name for k in candidates}) if opts.reconfirm else None
    if again and opts.deterministic and registry.get(again[1]).run_to_run(problem, again[2]):
        again = None  # searched instead, among the candidates that do not vary
    known, measured_by = ({}, {}) if again else _known_results(writer, sku, problem, registry)
    neighbours = [] if again else _neighbour_winners(rows, sku, problem, registry)
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
        if again:
            results = remeasure(problem, sku, measurer, candidates, [again[1:]])
        else:
            results = search(problem, sku, measurer, candidates, trials=opts.trials,
                             refine=opts.refine, seed=opts.seed, known=known, starts=neighbours,
                             storage=opts.optuna_storage, compiler=pool, progress=on_trial,
                             deterministic=opts.deterministic)
        confirming = time.perf_counter()
        decision = confirm(problem, sku, measurer, results,
                           reference_us=_quiet_reference(rows, known, sku, problem),
                           probe=lane.probe)
    except (TuningError, RuntimeError) as e:  # RuntimeError: torch's, measuring in-process
        return BucketOutcome(problem, None, 0, len(known), str(e), device=lane.device)
    fresh = [r for k, r in results.items() if k not in known]
    end = time.perf_counter()
    seconds = {"setup": searching - start,
               "compile_ahead": (pool.seconds if pool else 0.0) - compiled_before,
               "first_calls": sum(r.first_call_s for r in fresh),
               "timing": sum(r.timing_s for r in fresh),
               "confirm": end - confirming, "total": end - start}
    w, wt, bt = decision.winner, decision.winner_timing, decision.baseline_timing
    timed = tuple(b.to_row() for b in decision.baselines)
    kept = (_earlier_variants(rows, sku, problem, registry, db.Candidate(w.kernel, w.params), timed)
            if again else ())
    winner = db.WinnerEntry(w.kernel, w.params, wt.median_us, wt.p20_us, wt.p80_us, w.error,
                            decision.baseline.kernel, decision.baseline.params, bt.median_us,
                            baselines=timed + kept)
    writer.publish_bucket(run_id, sku.to_row(), problem.to_row(), [_record(r) for r in fresh],
                          winner, found_by=measured_by.get((w.kernel, params_key(w.params))))
    return BucketOutcome(problem, decision, len(fresh), len(known), seconds=seconds,
                         device=lane.device, reconfirmed=again[0] if again else None)


def _varies(row: db.WinnerRecord, problem: MoEProblem, registry: Registry) -> bool:
    """Whether a table winner's bits may change between calls (params as validated today)."""
    point = row_point(row, registry)
    return point is None or bool(registry.get(row.kernel).run_to_run(problem, point[1]))


def _quiet_reference(rows: Iterable[db.WinnerRecord], known: dict[Key, Result], sku: SKU,
                     problem: MoEProblem) -> float | None:
    """The fastest time the table has recorded for today's rule's pick in ``problem``'s
    bucket on ``sku``: as a baseline of its winner row, or as a trial of an earlier run (in
    ``known``); None without history. ``confirm`` refuses a winner over a rule's pick far
    slower than this (``SUSTAINED``)."""
    rule = rule_choice(problem, sku)
    key = (rule.kernel, params_key(rule.params))
    times = [r.median_us for k, r in known.items() if k == key and r.status is Status.OK]
    here, bucket = (sku.vendor.value, sku.name, sku.arch), problem.to_row()
    for row in rows:
        if (row.sku["vendor"], row.sku["name"], row.sku["arch"]) == here and row.bucket == bucket:
            times += [b.median_us for b in row.baselines if b.median_us and b.stands_for(rule)]
    return min(times, default=None)


def _table_winner(rows: Iterable[db.WinnerRecord], sku: SKU, problem: MoEProblem,
                  registry: Registry, candidates: set[str]
                  ) -> tuple[int, str, dict[str, Any]] | None:
    """The run, kernel and params (as validated today) of the table's winner for ``problem``
    on ``sku``, whatever versions it was timed under and whatever rule it was timed against,
    when its kernel is a candidate here; else None."""
    for row in rows:
        if row_verdict(row, sku).other_sku or row.kernel not in candidates:
            continue
        point = row_point(row, registry)
        if point is not None and point[0] == problem:
            return row.run_id, row.kernel, point[1]
    return None


def _earlier_variants(rows: Iterable[db.WinnerRecord], sku: SKU, problem: MoEProblem,
                      registry: Registry, winner: db.Candidate,
                      timed: tuple[db.BaselineRecord, ...]) -> tuple[db.BaselineRecord, ...]:
    """The variants of the bucket's earlier row that this re-confirmation did not time (another
    vLLM's pick, the emulation where vLLM is absent), kept as that row measured them where the
    winner is still that row's winner: a machine whose rule is one of them keeps serving the
    row as before. Where the winner changed, their verdicts were on another kernel: dropped."""
    here, bucket = (sku.vendor.value, sku.name, sku.arch), problem.to_row()
    for row in rows:
        if ((row.sku["vendor"], row.sku["name"], row.sku["arch"]) != here
                or row.bucket != bucket or row.source != "measured"):
            continue
        point = row_point(row, registry)
        if point is None or db.Candidate(row.kernel, point[1]) != winner:
            return ()
        return tuple(b for b in row.baselines if not any(t.stands_for(b) for t in timed))
    return ()


def _record(r: Result) -> db.MeasurementRecord:
    t = r.timing
    return db.MeasurementRecord(r.kernel, r.params, r.status, t.median_us if t else None,
                                t.p20_us if t else None, t.p80_us if t else None,
                                t.samples if t else 0, r.error, r.reason)


def _neighbour_winners(rows: Iterable[db.WinnerRecord], sku: SKU, problem: MoEProblem,
                       registry: Registry) -> list[tuple[str, dict[str, Any]]]:
    """The measured winners among a table's ``rows`` on ``sku`` for ``problem``'s shape at the
    nearest smaller and the nearest larger num_tokens (params as validated today), for the
    search to measure early: tiles that win one bucket often win the next, and a search from
    the rule's pick and each family's seed alone missed them (on the H200 a re-tune from another
    sampler seed found DeepSeek-V3 rows at 1536-4096 tokens 4-8% faster than the table's)."""
    shape = dataclasses.replace(problem, num_tokens=1)
    below: tuple[int, str, dict[str, Any]] | None = None
    above: tuple[int, str, dict[str, Any]] | None = None
    for row in rows:
        if row.source != "measured" or row_verdict(row, sku).other_sku:
            continue
        point = row_point(row, registry)
        if point is None or dataclasses.replace(point[0], num_tokens=1) != shape:
            continue
        m = point[0].num_tokens
        if m < problem.num_tokens and (below is None or m > below[0]):
            below = (m, row.kernel, point[1])
        if m > problem.num_tokens and (above is None or m < above[0]):
            above = (m, row.kernel, point[1])
    return [(kernel, params) for _, kernel, params in filter(None, (below, above))]


def _known_results(writer: db.TableWriter, sku: SKU, problem: MoEProblem,
                   registry: Registry) -> tuple[dict[Key, Result], dict[Key, int]]:
    """Measurements earlier runs (this job's included) left in the table for this bucket, and
    the run that made each, keyed by their parameters as the kernel validates them today: a
    trial stored before its kernel gained a parameter is the point at that parameter's default,
    so the search neither times it again nor misses the new parameter's moves from it. Trials
    of kernels no longer registered, or outside today's space, are left out: nothing can
    reproduce them; so are trials of runs under other torch/triton/CUDA/HIP versions, whose
    compiled code, and so its time and even its correctness, need not be today's."""
    known: dict[Key, Result] = {}
    runs: dict[Key, int] = {}
    here = environment()
    for m in writer.measurements(sku.to_row(), problem.to_row()).values():
        if m.environment is None or environment_mismatches(m.environment, here):
            continue
        try:
            params = registry.get(m.kernel).validate(m.params)
        except (UnknownKernelError, InvalidParamsError):
            continue
        key = (m.kernel, params_key(params))
        if runs.get(key, -1) > m.run_id:  # stored with and without the default: the newer
            continue
        timing = None
        if m.median_us is not None:
            timing = Timing(m.median_us, m.p20_us, m.p80_us, m.samples, "stored")
        known[key] = Result(m.kernel, params, m.status, timing, m.error, m.reason)
        runs[key] = m.run_id
    return known, runs
