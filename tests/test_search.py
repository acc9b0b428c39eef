"""The search's local phase: one-step moves from the best, then from the other families' best
and from the best's work per program in them, within its budget."""

from __future__ import annotations

from typing import Any

import pytest

from moetune.runtime.kernels.base import BaseKernel, Param, params_key
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import rule_choice
from moetune.tuner.measure import Result, Status
from moetune.tuner.search import neighbours, search
from moetune.tuner.timing import Timing

OPTIMUM = {"a": 4, "b": 2, "c": 5}


class Bowl(BaseKernel):
    """A kernel whose time is a bowl over three ordered parameters, seeded in a far corner."""

    name = "bowl"
    params = (Param("a", (1, 2, 3, 4, 5)), Param("b", (1, 2, 3, 4, 5)),
              Param("c", (1, 2, 3, 4, 5)))

    @classmethod
    def seed_params(cls, problem, sku) -> dict[str, Any]:
        return {"a": 1, "b": 5, "c": 1}

    @classmethod
    def prepare(cls, problem, params, weights):
        raise AssertionError("the fake measurer never runs a kernel")


class BowlMeasurer:
    """Times from a formula; the rule's kernel is slow. Keeps the order of what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def measure(self, kernel: str, params: dict[str, Any], cutoff_us: float | None = None) -> Result:
        self.calls.append((kernel, params))
        us = 100 + sum((params[k] - v) ** 2 for k, v in OPTIMUM.items()) if kernel == "bowl" \
            else 1000.0
        return Result(kernel, params, Status.OK, Timing(us, us, us, 1, "formula"))

    def retime(self, kernel: str, params: dict[str, Any], reps: int) -> Timing:
        raise AssertionError("the search never re-times")


@pytest.fixture
def candidates(small_problem, cpu_sku) -> list[type[BaseKernel]]:
    return [default_registry.get(rule_choice(small_problem, cpu_sku).kernel), Bowl]


def bowl_calls(measurer: BowlMeasurer) -> list[dict[str, Any]]:
    return [p for k, p in measurer.calls if k == "bowl"]


def test_local_search_walks_from_the_seed_to_the_optimum_and_stops_there(
        small_problem, cpu_sku, candidates):
    measurer = BowlMeasurer()
    results = search(small_problem, cpu_sku, measurer, candidates, trials=2, refine=200)
    best = min(results.values(), key=lambda r: r.median_us)
    assert best.params == OPTIMUM
    calls = bowl_calls(measurer)
    assert len(calls) < 60  # it stopped where no move gains, far short of its budget
    assert len({tuple(sorted(p.items())) for p in calls}) == len(calls)  # never re-measured


def test_local_search_spends_at_most_its_budget(small_problem, cpu_sku, candidates):
    without, within = BowlMeasurer(), BowlMeasurer()
    search(small_problem, cpu_sku, without, candidates, trials=2, refine=0)
    search(small_problem, cpu_sku, within, candidates, trials=2, refine=7)
    assert len(within.calls) == len(without.calls) + 7
    assert OPTIMUM not in bowl_calls(within)  # 7 moves cannot reach it from the far corner


def test_local_search_climbs_from_the_best_stored_trial(small_problem, cpu_sku, candidates):
    # A trial an earlier run stored next to the optimum, which this run's trials do not reach.
    near = {"a": 4, "b": 2, "c": 4}
    stored = Result("bowl", near, Status.OK, Timing(101.0, 101.0, 101.0, 1, "stored"))
    measurer = BowlMeasurer()
    results = search(small_problem, cpu_sku, measurer, candidates, trials=2, refine=6,
                     known={("bowl", params_key(near)): stored})
    calls = bowl_calls(measurer)
    assert calls.count(near) == 1  # measured again (gated, timed here) before the climb
    assert OPTIMUM in calls  # one of its 6 one-step moves
    assert min(results.values(), key=lambda r: r.median_us).params == OPTIMUM


def test_deterministic_search_never_measures_or_keeps_a_varying_configuration(
        small_problem, cpu_sku):
    class VaryingBowl(Bowl):
        @classmethod
        def run_to_run(cls, problem, params):
            return "adds with atomics" if params["c"] == 5 else None

    stored = Result("bowl", OPTIMUM, Status.OK, Timing(100.0, 100.0, 100.0, 1, "stored"))
    rule = default_registry.get(rule_choice(small_problem, cpu_sku).kernel)
    measurer = BowlMeasurer()
    results = search(small_problem, cpu_sku, measurer, [rule, VaryingBowl], trials=8,
                     refine=200, known={("bowl", params_key(OPTIMUM)): stored},
                     deterministic=True)
    assert all(p["c"] != 5 for p in bowl_calls(measurer))
    pruned = [r for r in results.values() if r.status is Status.PRUNED]
    assert pruned and all(r.reason == "--deterministic: adds with atomics" for r in pruned)
    best = min((r for r in results.values() if r.status is Status.OK), key=lambda r: r.median_us)
    assert best.params == {"a": 4, "b": 2, "c": 4}  # the optimum among those that do not vary
    free = BowlMeasurer()
    search(small_problem, cpu_sku, free, [rule, VaryingBowl], trials=8, refine=200)
    assert OPTIMUM in bowl_calls(free)


def test_neighbours_move_one_parameter_one_step():
    class Mixed(Bowl):
        params = (Param("n", (16, 32, 64)), Param("mode", ("atomic", "ordered", "two_pass")))

    moves = neighbours(Mixed, {"n": 16, "mode": "ordered"})
    assert moves == [{"n": 32, "mode": "ordered"}, {"n": 16, "mode": "atomic"},
                     {"n": 16, "mode": "two_pass"}]
    # A value outside the declared choices (a vLLM tuned-file config) is kept, the rest move.
    assert neighbours(Mixed, {"n": 8, "mode": "atomic"}) == [
        {"n": 8, "mode": "ordered"}, {"n": 8, "mode": "two_pass"}]


def test_neighbours_move_declared_pairs_together():
    class Tiled(Bowl):
        params = (Param("tile", (16, 32, 64), moves_with=(("warps", 1), ("stages", -1))),
                  Param("warps", (4, 8)), Param("stages", (2, 3)))

    moves = neighbours(Tiled, {"tile": 32, "warps": 4, "stages": 2})
    paired = [m for m in moves if sum(m[k] != v for k, v in
                                      {"tile": 32, "warps": 4, "stages": 2}.items()) == 2]
    # Shrinking: warps cannot go below 4, stages go up; growing: more warps, stages stay at 2.
    assert paired == [{"tile": 16, "warps": 4, "stages": 3}, {"tile": 64, "warps": 8, "stages": 2}]
    assert moves[:len(moves) - 2] == [  # the single moves first, as before
        {"tile": 16, "warps": 4, "stages": 2}, {"tile": 64, "warps": 4, "stages": 2},
        {"tile": 32, "warps": 8, "stages": 2}, {"tile": 32, "warps": 4, "stages": 3}]


def test_triton_tiles_move_with_their_warps_and_k_steps_with_their_stages():
    from moetune.runtime.kernels.moetune_grouped import MoetuneGroupedKernel

    params = {p.name: p.choices[1] for p in MoetuneGroupedKernel.params}
    params |= {"g1_BLOCK_SIZE_M": 64, "g1_num_warps": 4, "g1_BLOCK_SIZE_K": 128,
               "g1_num_stages": 3, "g2_num_warps": 4}
    moves = neighbours(MoetuneGroupedKernel, params)
    assert params | {"g1_BLOCK_SIZE_M": 128, "g1_num_warps": 8} in moves
    assert params | {"g1_BLOCK_SIZE_K": 256, "g1_num_stages": 2} in moves
    assert params | {"g1_BLOCK_SIZE_M": 128, "g2_num_warps": 8} not in moves  # per GEMM



def seeded(kernel: type[BaseKernel], name: str, seed: dict[str, int],
           **fields: Any) -> type[BaseKernel]:
    """``kernel`` under another name with another seed (and other class fields)."""
    return type(name, (kernel,), {"name": name, **fields,
                                  "seed_params": classmethod(lambda cls, p, s: dict(seed))})


class TwoFamilies(BowlMeasurer):
    """Bowl's bowl, and family ``ridge``: 10 us faster at its own optimum, ``twin``: 5 us faster
    than bowl everywhere."""

    RIDGE = {"a": 2, "b": 4, "c": 5}

    def measure(self, kernel: str, params: dict[str, Any],
                cutoff_us: float | None = None) -> Result:
        self.calls.append((kernel, params))
        if kernel in ("bowl", "twin", "ridge"):
            optimum = self.RIDGE if kernel == "ridge" else OPTIMUM
            floor = {"bowl": 100.0, "twin": 95.0, "ridge": 90.0}[kernel]
            us = floor + sum((params[k] - v) ** 2 for k, v in optimum.items())
        else:
            us = 1000.0
        return Result(kernel, params, Status.OK, Timing(us, us, us, 1, "formula"))


def best_of(results) -> tuple[str, dict[str, Any], float]:
    best = min(results.values(), key=lambda r: r.median_us)
    return best.kernel, best.params, best.median_us


def test_local_search_climbs_the_other_families_close_to_the_best(small_problem, cpu_sku):
    rule = default_registry.get(rule_choice(small_problem, cpu_sku).kernel)
    bowl = seeded(Bowl, "bowl", OPTIMUM)  # 100 us, where no move gains
    # ridge at its seed: 90 + 9 + 9 = 108 us, within PEER_MARGIN of 100: climbed to its 90 us.
    near = seeded(Bowl, "ridge", {"a": 5, "b": 1, "c": 5})
    results = search(small_problem, cpu_sku, TwoFamilies(), [rule, bowl, near], trials=3, refine=60)
    assert best_of(results) == ("ridge", TwoFamilies.RIDGE, 90.0)
    # 90 + 9 + 9 + 4 = 112 us is not close enough: only the winner's family is climbed.
    far = seeded(Bowl, "ridge", {"a": 5, "b": 1, "c": 3})
    measurer = TwoFamilies()
    results = search(small_problem, cpu_sku, measurer, [rule, bowl, far], trials=3, refine=60)
    assert best_of(results) == ("bowl", OPTIMUM, 100.0)
    assert [p for k, p in measurer.calls if k == "ridge"] == [{"a": 5, "b": 1, "c": 3}]


def test_local_search_measures_the_best_work_per_program_in_the_other_families(
        small_problem, cpu_sku):
    rule = default_registry.get(rule_choice(small_problem, cpu_sku).kernel)
    as_configs = classmethod(lambda cls, problem, params: (dict(params), {}))
    from_configs = classmethod(lambda cls, problem, gemm1, gemm2: dict(gemm1))
    bowl = seeded(Bowl, "bowl", {"a": 3, "b": 2, "c": 5}, gemm_configs=as_configs)
    # twin's seed is 95 + 9 + 9 + 16 = 129 us, too slow to climb from; bowl climbs to its
    # optimum, and twin at that point (95 us) wins.
    twin = seeded(Bowl, "twin", {"a": 1, "b": 5, "c": 1}, from_gemm_configs=from_configs)
    measurer = TwoFamilies()
    results = search(small_problem, cpu_sku, measurer, [rule, bowl, twin], trials=3, refine=60)
    assert best_of(results) == ("twin", OPTIMUM, 95.0)
    twin_calls = [p for k, p in measurer.calls if k == "twin"]
    assert twin_calls[1] == OPTIMUM  # right after its seed: the translation, not a climb
    # Without the translation twin is never climbed, and bowl's optimum stays the best.
    plain = seeded(Bowl, "twin", {"a": 1, "b": 5, "c": 1})
    results = search(small_problem, cpu_sku, TwoFamilies(), [rule, bowl, plain], trials=3,
                     refine=60)
    assert best_of(results) == ("bowl", OPTIMUM, 100.0)


def test_every_family_is_measured_at_its_seed_however_small_the_budget(small_problem, cpu_sku):
    """One trial for the rule and three other families: each family's seed is still measured
    (the budget once ran out on the starts, and families enqueued late were never tried)."""
    rule = default_registry.get(rule_choice(small_problem, cpu_sku).kernel)
    families = [seeded(Bowl, name, OPTIMUM) for name in ("bowl", "twin", "ridge")]
    measurer = TwoFamilies()
    search(small_problem, cpu_sku, measurer, [rule, *families], trials=1, refine=0)
    assert {k for k, _ in measurer.calls} == {rule.name, "bowl", "twin", "ridge"}


def test_a_stored_study_resumes_only_over_the_same_families(small_problem, cpu_sku, tmp_path,
                                                             candidates):
    """A family added (or newly eligible) since a study was stored gets a study of its own:
    Optuna refuses to resume one whose ``kernel`` choices differ."""
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    search(small_problem, cpu_sku, BowlMeasurer(), candidates, trials=2, refine=0,
           storage=storage)
    again = BowlMeasurer()
    search(small_problem, cpu_sku, again, candidates, trials=2, refine=0, storage=storage)
    newcomer = seeded(Bowl, "newcomer", OPTIMUM)
    results = search(small_problem, cpu_sku, BowlMeasurer(), [*candidates, newcomer], trials=2,
                     refine=0, storage=storage)
    assert ("newcomer", params_key(OPTIMUM)) in results
