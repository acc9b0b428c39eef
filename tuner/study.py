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
from moetune.runtime.rules import RuleChoice, rule_variants
from moetune.tuner.measure import CandidateMeasurer, Result, Status
from moetune.tuner.precompile import CompilePool
from moetune.tuner.timing import Timing

Key = tuple[str, str]

# Repeats and pruned configurations cost an ask but no budget; this bounds the asks.
_MAX_ASKS_PER_TRIAL = 20
# A candidate this many times slower than the best so far is timed only roughly.
CUTOFF_FACTOR = 1.5


@dataclasses.dataclass(frozen=True)
class Baseline:
    """One rule variant timed beside the winner: its pooled timing and the winner's speedup
    over it, taken round by round (``ratio_lo``/``ratio_hi``: the lowest and highest round but
    one, so one disturbed round moves neither). ``beaten``: the winner is faster in every
    round but at most one, and in the median."""

    kernel: str
    params: dict[str, Any]
    timing: Timing
    rounds: int
    ratio_lo: float
    ratio_hi: float
    beaten: bool

    def to_row(self) -> dict[str, Any]:
        """The form a winner row stores (``WinnerRecord.baselines``)."""
        return {"kernel": self.kernel, "params": self.params, "median_us": self.timing.median_us,
                "p20_us": self.timing.p20_us, "p80_us": self.timing.p80_us,
                "rounds": self.rounds, "ratio_lo": self.ratio_lo, "ratio_hi": self.ratio_hi,
                "beaten": self.beaten}


@dataclasses.dataclass(frozen=True)
class Decision:
    """A bucket's outcome: the winner and every rule variant as timed side by side in
    confirmation (``baselines[0]`` is the rule where the bucket was tuned)."""

    winner: Result
    winner_timing: Timing
    baselines: tuple[Baseline, ...]
    reason: str
    results: tuple[Result, ...]

    @property
    def baseline(self) -> Baseline:
        return self.baselines[0]

    @property
    def baseline_timing(self) -> Timing:
        return self.baselines[0].timing

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
    names = [k.name for k in candidates]
    variants = _variants(problem, sku, names)
    rule = variants[0]
    by_name = {k.name: k for k in candidates}
    batch = compiler.workers if compiler else 1
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(trials // 3, 1)),
                                         constant_liar=batch > 1)
    study = optuna.create_study(direction="minimize", sampler=sampler, storage=storage,
                                study_name=f"moetune:{problem.describe()}", load_if_exists=True)
    starts = [(v.kernel, v.params) for v in variants] + [
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
    for variant in variants:  # the budget or a resumed study skipped it: always measure it
        key = (variant.kernel, params_key(variant.params))
        if key not in results:
            results[key] = known.get(key) or measurer.measure(variant.kernel, variant.params)
    return results


def _variants(problem: MoEProblem, sku: SKU, names: list[str]) -> list[RuleChoice]:
    """The rule variants to time: the rule's pick (which must be eligible), then every other
    variant whose kernel is eligible here.

    Raises:
        TuningError: the rule's kernel is not among the candidates.
    """
    rule, *others = rule_variants(problem, sku)
    if rule.kernel not in names:
        raise TuningError(f"{problem.describe()}: the rule's kernel {rule.kernel} is not eligible")
    return [rule] + [v for v in others if v.kernel in names]


def _tell(study: optuna.Study, trial: optuna.Trial, result: Result) -> None:
    if result.status is Status.OK:
        study.tell(trial, result.median_us)
    else:
        state = optuna.trial.TrialState.PRUNED if result.status is Status.PRUNED else \
            optuna.trial.TrialState.FAIL
        study.tell(trial, state=state)


def confirm(problem: MoEProblem, sku: SKU, measurer: CandidateMeasurer, results: dict[Key, Result], *,
            top: int = 3, rounds: int = 5, reps: int = 10) -> Decision:
    """Re-time the rule variants and the best ``top`` candidates interleaved, and decide.

    Each round times every finalist once, so the winner's speedup over a baseline is taken
    within a round (a slow phase of the machine slows both). The fastest finalist wins only if
    it beats the rule's pick (``rule_variants(...)[0]``) in every round but at most one and in
    the median ratio; otherwise the rule's pick is kept: a near-tie is noise, and the rule
    needs no table row to be right. Every variant is recorded with the winner's ratios over it.

    Raises:
        TuningError: the rule's pick failed or was wrong (nothing trustworthy to compare to).
    """
    variants = rule_variants(problem, sku)
    keys = [(v.kernel, params_key(v.params)) for v in variants]
    bases = [results[keys[0]]] + [results[k] for k in keys[1:] if k in results]
    if bases[0].status is not Status.OK:
        raise TuningError(f"{problem.describe()}: baseline {bases[0].kernel} "
                          f"{bases[0].status.value}: {bases[0].reason}")
    bases = [b for b in bases if b.status is Status.OK]  # a variant that fails here is no rule
    ok = sorted((r for r in results.values() if r.status is Status.OK), key=lambda r: r.median_us)
    finalists = bases + [r for r in ok[:top] if all(r is not b for b in bases)]
    samples: list[list[Timing]] = [[] for _ in finalists]
    for _ in range(rounds):
        for i, r in enumerate(finalists):
            samples[i].append(measurer.retime(r.kernel, r.params, reps))
    timings = [_pooled(s) for s in samples]
    best = min(range(len(finalists)), key=lambda i: timings[i].median_us)
    if best != 0 and not _beats(samples[best], samples[0]):
        reason = (f"near-tie: {finalists[best].kernel} {timings[best].median_us:.1f}us does not "
                  f"beat the rule's pick ({timings[0].median_us:.1f}us) in enough rounds")
        best = 0
    else:
        reason = "baseline kept" if best == 0 else (
            f"{timings[0].median_us / timings[best].median_us:.2f}x over baseline")
    baselines = tuple(_baseline(b, samples[i], timings[i], samples[best])
                      for i, b in enumerate(bases))
    return Decision(finalists[best], timings[best], baselines, reason, tuple(results.values()))


def _ratios(winner: list[Timing], baseline: list[Timing]) -> list[float]:
    """The winner's speedup over the baseline in each round, ascending."""
    return sorted(b.median_us / w.median_us for w, b in zip(winner, baseline))


def _beats(winner: list[Timing], baseline: list[Timing]) -> bool:
    """Faster in every round but at most one, and in the median round."""
    ratios = _ratios(winner, baseline)
    trimmed = ratios[1] if len(ratios) > 2 else ratios[0]
    return trimmed > 1.0 and statistics.median(ratios) > 1.0


def _baseline(result: Result, rounds: list[Timing], timing: Timing,
              winner: list[Timing]) -> Baseline:
    ratios = _ratios(winner, rounds)
    trim = 1 if len(ratios) > 2 else 0
    return Baseline(result.kernel, result.params, timing, len(rounds), ratios[trim],
                    ratios[-1 - trim], rounds is not winner and _beats(winner, rounds))


def _pooled(rounds: list[Timing]) -> Timing:
    """Median of the rounds' medians, with the rounds' typical p20/p80 offsets around it: one
    disturbed round (another process, a clock change) moves neither."""
    median = statistics.median(t.median_us for t in rounds)
    below = statistics.median(t.median_us - t.p20_us for t in rounds)
    above = statistics.median(t.p80_us - t.median_us for t in rounds)
    return Timing(median, median - below, median + above, sum(t.samples for t in rounds),
                  "confirm")

