"""One bucket's search: an Optuna study over (kernel, that kernel's parameters), asked in
batches the compile pool builds ahead of timing, measured one candidate after another, then a
local search from the best: one-step moves of one parameter at a time (and of the pairs a
kernel declares move together, like a tile and its warps), while they gain; then
from the best's work per program in the other families that share vLLM's config space, and
from every family close to the best.

The local search is what finds the best configs: replayed against exhaustively timed grids on
an H200 (``scripts/audit_search.py``, bench/results/audit-h200-2026-12-01), the sampler alone
stayed 9% slower than the best at 2048 tokens and 1% at 64, with 16, 24 or 48 trials alike;
the local search came within 0.3% in every replay, using at most 32 evaluations. Families are
climbed one by one because their optima differ: at Qwen3-30B-A3B's 4096 tokens moetune_grouped,
measured only at its seed, was 2-11% behind aiter's climbed best, and within 1% of it at that
best's tiles (bench/results/grouped-h200-2026-12-02)."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import optuna

from moetune.errors import TuningError
from moetune.runtime.kernels.base import BaseKernel, params_key
from moetune.runtime.platform import SKU
from moetune.runtime.problem import MoEProblem
from moetune.runtime.rules import RuleChoice, rule_variants
from moetune.tuner.measure import CandidateMeasurer, Key, Result, Status
from moetune.tuner.procs.compile_pool import CompilePool

# Repeats and pruned configurations cost an ask but no budget; this bounds the asks.
_MAX_ASKS_PER_TRIAL = 20
# A candidate this many times slower than the best so far is timed only roughly.
CUTOFF_FACTOR = 1.5
#: Default budgets: the sampler's trials, and what the local search may add (the audit's 32
#: for the winner's family, whose climb stops before that as a rule, and 16 for the others).
TRIALS = 24
REFINE = 48
#: After the winner's family, the local search climbs every other family whose best is within
#: this factor of the best, fastest first, while budget is left.
PEER_MARGIN = 1.10


def search(problem: MoEProblem, sku: SKU, measurer: CandidateMeasurer, candidates: list[type[BaseKernel]],
           *, trials: int, refine: int = REFINE, seed: int = 0,
           known: dict[Key, Result] | None = None,
           starts: Sequence[tuple[str, dict[str, Any]]] = (),
           storage: optuna.storages.BaseStorage | str | None = None,
           compiler: CompilePool | None = None,
           progress: Callable[[], None] | None = None,
           deterministic: bool = False) -> dict[Key, Result]:
    """Measure up to ``trials`` distinct configurations chosen by an Optuna study, then up to
    ``refine`` more by a local search from the best.

    The rule's pick is enqueued first, then every other kernel's seed configuration (so each
    family is measured at least once at a sensible point before the sampler specializes), then
    ``starts`` (the winners of neighbouring buckets); these starts are measured even where
    ``trials`` is smaller; a
    rule's pick outside the search space (a vLLM tuned-file config) is measured after the
    sampler's trials.
    Configurations pruned before running and repeats do not use up the budget. With
    ``deterministic``, configurations whose bits may change between calls (``run_to_run``) are
    pruned, the stored times of earlier runs included.

    With a ``compiler``, trials are asked in batches of its worker count (TPE with a constant
    liar, so a batch spreads out); the batch's new JIT candidates are compiled in parallel,
    then timed one after another. A candidate that fails there is recorded as failed.
    A candidate whose first repetitions are ``CUTOFF_FACTOR`` times slower than the best so
    far is not timed further: the ranking needs no precise time for it.

    The local search starts from the best of what was measured and the best of ``known`` (the
    table's own trials for the bucket, which a re-run after a kernel gained a parameter would
    not sample again; measured again first). It measures every one-step move of the best
    configuration (``neighbours``)
    as one batch, moves to the best of them if it is faster, and stops at a configuration no
    move improves. It then measures the best's work per program in the other families
    (``translations``), and climbs the same way from the best of each family within
    ``PEER_MARGIN`` of the overall best, fastest first. All of it stops when ``refine``
    evaluations are spent.

    Args:
        known: results measured earlier (a resumed job); they are told to Optuna, not re-timed.
        starts: (kernel, params) to measure among the first; those of kernels that are not
            candidates here, or outside their space, are left out.
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
                                study_name=study_name(problem, names), load_if_exists=True)
    firsts = [(v.kernel, v.params) for v in variants] + [
        (k.name, k.seed_params(problem, sku)) for k in candidates if k.name != rule.kernel] + [
        (name, params) for name, params in starts if name in by_name]
    enqueued = 0
    for name, params in firsts:  # the rule's pick may lie outside the space: measured anyway
        if params is not None and by_name[name].searchable(params):
            study.enqueue_trial({"kernel": name, **{f"{name}.{k}": v for k, v in params.items()}})
            enqueued += 1
    # Every start is measured, however small the budget: with fewer trials than starts the
    # families enqueued last (moetune's own) were never measured in a bucket without known
    # trials (Qwen3-235B-A22B at 1 token, --trials 8: aiter's kernels only).
    trials = max(trials, enqueued)
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

    def measure(new: dict[Key, tuple[str, dict[str, Any]]]) -> None:
        """Compile ``new`` ahead where it compiles, then time it one by one."""
        ahead = {key: c for key, c in new.items() if by_name[c[0]].compiles}
        failed = dict(zip(ahead, compiler.compile(list(ahead.values())))) if compiler else {}
        for key, (name, params) in new.items():
            why = failed.get(key)
            best = fastest()
            done(key, Result(name, params, Status.FAILED, reason=f"compiling ahead: {why}")
                 if why else measurer.measure(
                     name, params, None if best is None else best.median_us * CUTOFF_FACTOR))

    def fastest() -> Result | None:
        return min((r for r in results.values() if r.status is Status.OK),
                   key=lambda r: r.median_us, default=None)

    def take(kernel: type[BaseKernel], params: dict[str, Any], key: Key,
             new: dict[Key, tuple[str, dict[str, Any]]]) -> None:
        """A configuration not tried yet: known from a resumed job, pruned, or to measure."""
        why = kernel.check_params(problem, params)
        varies = deterministic and kernel.run_to_run(problem, params)
        if varies:  # a stored time of it is no candidate either
            done(key, Result(kernel.name, params, Status.PRUNED,
                             reason=f"--deterministic: {varies}"))
        elif key in known or why:
            done(key, known.get(key) or Result(kernel.name, params, Status.PRUNED, reason=why))
        else:
            new[key] = (kernel.name, params)

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
                take(kernel, params, key, new)
            if key in results:
                _tell(study, trial, results[key])
            else:
                waiting.append((trial, key))
        measure(new)
        for trial, key in waiting:
            _tell(study, trial, results[key])
    for variant in variants:  # the budget or a resumed study skipped it: always measure it
        key = (variant.kernel, params_key(variant.params))
        if key not in results:
            results[key] = known.get(key) or measurer.measure(variant.kernel, variant.params)
    # The climb starts from the best the table holds for the bucket, not only from what this
    # run's trials reached: once a kernel gained a parameter the sampler's points move, and the
    # stored best (at the parameter's default) is where its new values are worth trying. It is
    # measured again first (gated by today's code, timed on today's machine).
    stored = min((r for key, r in known.items() if key not in results
                  and r.status is Status.OK and r.kernel in by_name
                  and by_name[r.kernel].check_params(problem, r.params) is None
                  and not (deterministic and by_name[r.kernel].run_to_run(problem, r.params))),
                 key=lambda r: r.median_us, default=None)
    best = fastest()
    if stored is not None and (best is None or stored.median_us < best.median_us):
        measure({(stored.kernel, params_key(stored.params)): (stored.kernel, stored.params)})
    budget = measured + refine

    def family_fastest(name: str) -> Result | None:
        return min((r for r in results.values() if r.status is Status.OK and r.kernel == name),
                   key=lambda r: r.median_us, default=None)

    def climb(centre: Result) -> None:
        """Move to the best one-step move within ``centre``'s family while that gains."""
        kernel = by_name[centre.kernel]
        while measured < budget:
            new: dict[Key, tuple[str, dict[str, Any]]] = {}
            for params in neighbours(kernel, centre.params):
                key = (kernel.name, params_key(params))
                if key not in results and key not in new and len(new) < budget - measured:
                    take(kernel, params, key, new)
            measure(new)
            moved = family_fastest(kernel.name)
            if moved is None or moved is centre:
                return
            centre = moved

    climbed: set[str] = set()
    best = fastest()
    if best is not None:
        climb(best)
        climbed.add(best.kernel)
        new = {}
        for kernel, params in translations(problem, by_name, fastest()):
            key = (kernel.name, params_key(params))
            if key not in results and key not in new and len(new) < budget - measured:
                take(kernel, params, key, new)
        measure(new)
    while measured < budget:
        best = fastest()
        peers = sorted((r for r in map(family_fastest, names) if r and r.kernel not in climbed
                        and r.median_us <= best.median_us * PEER_MARGIN),
                       key=lambda r: r.median_us)
        if not peers:
            break
        climb(peers[0])
        climbed.add(peers[0].kernel)
    return results


def study_name(problem: MoEProblem, families: Sequence[str]) -> str:
    """The Optuna study of ``problem`` over ``families``. A stored study resumes only over the
    same families: Optuna refuses another set of choices for the ``kernel`` parameter
    ("CategoricalDistribution does not support dynamic value space"), which a new family, or one
    newly eligible, would be. Another set starts its own study; the table's trials still reach
    it (``known``)."""
    digest = hashlib.sha1(",".join(sorted(families)).encode()).hexdigest()[:8]
    return f"moetune:{problem.describe()}:{digest}"


def remeasure(problem: MoEProblem, sku: SKU, measurer: CandidateMeasurer,
              candidates: list[type[BaseKernel]],
              points: Sequence[tuple[str, dict[str, Any]]]) -> dict[Key, Result]:
    """The rule variants and ``points`` (kernel, params) each measured once, gated and timed:
    what the confirmation needs to decide a bucket again whose winner a table already names
    (``tune --reconfirm``), without a search. Points of kernels that are not candidates here
    are left out.

    Raises:
        TuningError: the rule's kernel is not among the candidates.
    """
    names = [k.name for k in candidates]
    firsts = [(v.kernel, v.params) for v in _variants(problem, sku, names)]
    results: dict[Key, Result] = {}
    for name, params in firsts + [(n, p) for n, p in points if n in names]:
        key = (name, params_key(params))
        if key not in results:
            results[key] = measurer.measure(name, params)
    return results


def translations(problem: MoEProblem, kernels: dict[str, type[BaseKernel]],
                 best: Result) -> list[tuple[type[BaseKernel], dict[str, Any]]]:
    """The other families' parameters doing ``best``'s work per program, where both sides
    speak vLLM's config space (``gemm_configs``, ``from_gemm_configs``)."""
    configs = kernels[best.kernel].gemm_configs(problem, best.params)
    if configs is None:
        return []
    out = []
    for kernel in kernels.values():
        params = None if kernel.name == best.kernel else kernel.from_gemm_configs(problem, *configs)
        if params is not None:
            out.append((kernel, params))
    return out


def neighbours(kernel: type[BaseKernel], params: dict[str, Any]) -> list[dict[str, Any]]:
    """``params`` with one parameter moved one step: to the next smaller or larger choice of a
    numeric parameter, to each other choice of an unordered one; then each numeric step again
    with every parameter it ``moves_with`` moved one step its way too. Values outside the
    declared choices (a vLLM tuned-file config) stay as they are."""
    by_name = {p.name: p for p in kernel.params}

    def step(name: str, values: dict[str, Any], way: int) -> dict[str, Any] | None:
        p = by_name[name]
        if values.get(name) not in p.choices:
            return None
        j = p.choices.index(values[name]) + way
        return values | {name: p.choices[j]} if 0 <= j < len(p.choices) else None

    moves, paired = [], []
    for p in kernel.params:
        value = params.get(p.name)
        if value not in p.choices:
            continue
        if not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in p.choices):
            moves += [params | {p.name: c} for c in p.choices if c != value]
            continue
        for way in (-1, 1):
            moved = step(p.name, params, way)
            if moved is None:
                continue
            moves.append(moved)
            paired += [both for other, sign in p.moves_with
                       if (both := step(other, moved, way * sign)) is not None]
    return moves + paired


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
