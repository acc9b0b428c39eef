"""One bucket's search: an Optuna study over (kernel, that kernel's parameters), then a
confirmation round that re-times the best few interleaved and decides the winner."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable

import optuna

from moetune.errors import TuningError
from moetune.runtime.kernels.base import BaseKernel, params_key
from moetune.runtime.platform import SKU
from moetune.runtime.problem import MoEProblem
from moetune.runtime.rules import rule_choice
from moetune.tuner.measure import CandidateMeasurer, Result, Status
from moetune.tuner.precompile import CompilePool
from moetune.tuner.timing import Timing

Key = tuple[str, str]

# Repeats and pruned configurations cost an ask but no budget; this bounds the asks.
_MAX_ASKS_PER_TRIAL = 20
# A candidate this many times slower than the best so far is timed only roughly.
CUTOFF_FACTOR = 1.5


@dataclasses.dataclass(frozen=True)
class Decision:
    """A bucket's outcome: the winner and the baseline as timed side by side in confirmation."""

    winner: Result
    winner_timing: Timing
    baseline: Result
    baseline_timing: Timing
    reason: str
    results: tuple[Result, ...]

    @property
    def speedup(self) -> float:
        return self.baseline_timing.median_us / self.winner_timing.median_us


def search(problem: MoEProblem, sku: SKU, measurer: CandidateMeasurer, candidates: list[type[BaseKernel]],
           *, trials: int, seed: int = 0, known: dict[Key, Result] | None = None,
           storage: optuna.storages.BaseStorage | str | None = None,
           compiler: CompilePool | None = None,
           progress: Callable[[], None] | None = None) -> dict[Key, Result]:
    """Measure up to ``trials`` distinct configurations chosen by an Optuna study.

    The rule's pick is enqueued first, then every other kernel's seed configuration (so each
    family is measured at least once at a sensible point before the sampler specializes); a
    rule's pick outside the search space (a vLLM tuned-file config) is measured at the end.
    Configurations pruned before running and repeats do not use up the budget.

    With a ``compiler``, trials are asked in batches of its worker count (TPE with a constant
    liar, so a batch spreads out); the batch's new JIT candidates are compiled in parallel,
    then timed one after another. A candidate that fails there is recorded as failed.
    A candidate whose first repetitions are ``CUTOFF_FACTOR`` times slower than the best so
    far is not timed further: the ranking needs no precise time for it.

    Args:
        known: results measured earlier (a resumed job); they are told to Optuna, not re-timed.
        progress: called after each trial (a progress bar's advance).

    Returns:
        Every distinct (kernel, params) tried, with its result.
    """
    rule = rule_choice(problem, sku)
    names = [k.name for k in candidates]
    if rule.kernel not in names:
        raise TuningError(f"{problem.describe()}: the rule's kernel {rule.kernel} is not eligible")
    by_name = {k.name: k for k in candidates}
    batch = compiler.workers if compiler else 1
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(trials // 3, 1)),
                                         constant_liar=batch > 1)
    study = optuna.create_study(direction="minimize", sampler=sampler, storage=storage,
                                study_name=f"moetune:{problem.describe()}", load_if_exists=True)
    starts = [(rule.kernel, rule.params)] + [
        (k.name, k.seed_params(problem, sku)) for k in candidates if k.name != rule.kernel]
    for name, params in starts:  # the rule's pick may lie outside the space: measured anyway
        if params is not None and by_name[name].searchable(params):
            study.enqueue_trial({"kernel": name, **{f"{name}.{k}": v for k, v in params.items()}})
    results: dict[Key, Result] = {}
    known = known or {}
    space = sum(k.space_size() for k in candidates)
    measured, asks = 0, 0

    def done(key: Key, result: Result) -> None:
        nonlocal measured
        results[key] = result
        if result.status is not Status.PRUNED:
            measured += 1
            if progress:
                progress()

    while measured < trials and len(results) < space and asks < trials * _MAX_ASKS_PER_TRIAL:
        waiting: list[tuple[optuna.Trial, Key]] = []  # told once their batch is measured
        new: dict[Key, tuple[str, dict[str, Any]]] = {}
        while (len(new) < min(batch, trials - measured) and len(results) + len(new) < space
               and asks < trials * _MAX_ASKS_PER_TRIAL):
            trial = study.ask()
            asks += 1
            kernel = by_name[trial.suggest_categorical("kernel", names)]
            params = kernel.suggest(trial)
            key = (kernel.name, params_key(params))
            if key not in results and key not in new:
                why = kernel.check_params(problem, params)
                if key in known or why:
                    done(key, known.get(key) or Result(kernel.name, params, Status.PRUNED,
                                                       reason=why))
                else:
                    new[key] = (kernel.name, params)
            if key in results:
                _tell(study, trial, results[key])
            else:
                waiting.append((trial, key))
        ahead = {key: c for key, c in new.items() if by_name[c[0]].compiles}
        failed = dict(zip(ahead, compiler.compile(list(ahead.values())))) if compiler else {}
        for key, (name, params) in new.items():
            why = failed.get(key)
            best = min((r.median_us for r in results.values() if r.status is Status.OK),
                       default=None)
            done(key, Result(name, params, Status.FAILED, reason=f"compiling ahead: {why}")
                 if why else measurer.measure(
                     name, params, None if best is None else best * CUTOFF_FACTOR))
        for trial, key in waiting:
            _tell(study, trial, results[key])
    rule_key = (rule.kernel, params_key(rule.params))
    if rule_key not in results:  # the budget or a resumed study skipped it: always measure it
        results[rule_key] = known.get(rule_key) or measurer.measure(rule.kernel, rule.params)
    return results


def _tell(study: optuna.Study, trial: optuna.Trial, result: Result) -> None:
    if result.status is Status.OK:
        study.tell(trial, result.median_us)
    else:
        state = optuna.trial.TrialState.PRUNED if result.status is Status.PRUNED else \
            optuna.trial.TrialState.FAIL
        study.tell(trial, state=state)


def confirm(problem: MoEProblem, sku: SKU, measurer: CandidateMeasurer, results: dict[Key, Result], *,
            top: int = 3, rounds: int = 5, reps: int = 10) -> Decision:
    """Re-time the best ``top`` candidates and the baseline interleaved, and pick the winner.

    A candidate whose median lies inside the baseline's p20-p80 spread loses to the baseline:
    a near-tie is noise, and the rule's pick needs no table row to be right.

    Raises:
        TuningError: the baseline itself failed or was wrong (nothing trustworthy to compare to).
    """
    rule = rule_choice(problem, sku)
    baseline = results[(rule.kernel, params_key(rule.params))]
    if baseline.status is not Status.OK:
        raise TuningError(f"{problem.describe()}: baseline {rule.kernel} {baseline.status.value}: "
                          f"{baseline.reason}")
    ok = sorted((r for r in results.values() if r.status is Status.OK), key=lambda r: r.median_us)
    finalists = [baseline] + [r for r in ok[:top] if r is not baseline]
    samples: dict[int, list[Timing]] = {i: [] for i in range(len(finalists))}
    for _ in range(rounds):
        for i, r in enumerate(finalists):
            samples[i].append(measurer.retime(r.kernel, r.params, reps))
    timings = [_pooled(s) for s in samples.values()]
    best = min(range(len(finalists)), key=lambda i: timings[i].median_us)
    base_t, best_t = timings[0], timings[best]
    if best == 0 or best_t.median_us >= base_t.p20_us:
        reason = "baseline kept" if best == 0 else (
            f"near-tie: {finalists[best].kernel} {best_t.median_us:.1f}us is inside the "
            f"baseline's spread ({base_t.p20_us:.1f}-{base_t.p80_us:.1f}us)")
        return Decision(baseline, base_t, baseline, base_t, reason, tuple(results.values()))
    return Decision(finalists[best], best_t, baseline, base_t,
                    f"{base_t.median_us / best_t.median_us:.2f}x over baseline",
                    tuple(results.values()))


def _pooled(rounds: list[Timing]) -> Timing:
    """Median of the rounds' medians, with the rounds' typical p20/p80 offsets around it: one
    disturbed round (another process, a clock change) moves neither."""
    median = statistics.median(t.median_us for t in rounds)
    below = statistics.median(t.median_us - t.p20_us for t in rounds)
    above = statistics.median(t.p80_us - t.median_us for t in rounds)
    return Timing(median, median - below, median + above, sum(t.samples for t in rounds),
                  "confirm")

