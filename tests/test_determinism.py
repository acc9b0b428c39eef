"""Run-to-run determinism: which kernels give the same bits in every call, and serving that
takes only those (``MOETUNE_DETERMINISTIC=1``), as ``lookup`` says.

On a GPU, float atomics add in the order the hardware runs them and float addition is not
associative, so a winner that adds more than two values into one output element with atomics
can change its last bits between two calls on the same inputs; that moved greedy tokens of a
top-8 model between two engine runs (bench/results/vllm-e2e-rounds-h100-2026-12-07).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.errors import InvalidProblemError
from moetune.runtime.dispatcher import Dispatcher
from moetune.runtime.kernels.base import BaseKernel, WeightLayout
from moetune.runtime.kernels.moetune_decode import MoetuneDecodeKernel
from moetune.runtime.kernels.moetune_grouped import MoetuneGroupedKernel
from moetune.runtime.plan import Outcome, ShapePlan
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import default_registry
from moetune.serving.settings import Settings

from tests.vllm_tables import write_winners

H200 = SKU(Vendor.NVIDIA, "H200", "sm_90", 132, 141 << 30)


def grouped(problem: MoEProblem, reduce: str) -> dict:
    return MoetuneGroupedKernel.seed_params(problem, H200) | {"REDUCE": reduce}


@pytest.mark.parametrize(("topk", "reduce", "varies"), [
    (8, "atomic_out", True), (8, "atomic", True), (8, "sum", False),
    (2, "atomic_out", False), (2, "atomic", False), (1, "atomic", False)])
def test_grouped_reduces_vary_only_with_more_than_two_atomic_addends(topk, reduce, varies):
    problem = MoEProblem(64, 2048, 768, 128, topk)
    why = MoetuneGroupedKernel.run_to_run(problem, grouped(problem, reduce))
    assert bool(why) == varies
    if varies:
        assert f"REDUCE={reduce}" in why and f"adds {topk} partial rows" in why


@pytest.mark.parametrize(("topk", "split", "reduce", "varies"), [
    (1, 4, "atomic", True), (1, 2, "atomic", False), (2, 2, "atomic_out", True),
    (8, 1, "atomic", True), (8, 4, "ordered", False)])
def test_decode_counts_split_k_partials_as_addends(topk, split, reduce, varies):
    params = {"SPLIT_K": split, "REDUCE": reduce}
    assert bool(MoetuneDecodeKernel.run_to_run(MoEProblem(1, 2048, 768, 128, topk),
                                               params)) == varies


def test_a_family_is_deterministic_only_where_it_was_checked():
    class Unchecked(BaseKernel):
        name = "unchecked"

        @classmethod
        def prepare(cls, problem, params, weights):
            raise NotImplementedError

    problem = MoEProblem(8, 64, 32, 4, 2)
    assert "not checked" in Unchecked.run_to_run(problem, {})
    for name in ("vllm_triton", "vllm_triton_tuned", "moetune_grouped_mm", "torch_grouped"):
        assert default_registry.get(name).run_to_run(problem, {}) is None, name
    assert default_registry.get("aiter_triton_e2e").run_to_run(problem, {})


@pytest.fixture
def top8_table(tmp_path):
    """An H200 table whose winner at 64 tokens adds top-8 rows with atomics and at 128 tokens
    sums them in order."""
    problem = MoEProblem(64, 2048, 768, 128, 8)
    write_winners(tmp_path / "t.db", problem.shape, [64], "moetune_grouped",
                  grouped(problem, "atomic_out"), sku=H200)
    write_winners(tmp_path / "t.db", problem.shape, [128], "moetune_grouped",
                  grouped(problem.shape.problem(128), "sum"), sku=H200)
    return tmp_path / "t.db", problem.shape


def test_deterministic_serving_leaves_varying_winners_to_vllm(top8_table):
    path, shape = top8_table
    dispatcher = Dispatcher.load(path, H200, check_environment=False)
    every = ShapePlan.build(dispatcher, shape, WeightLayout.PLAIN)
    assert {m: c.outcome for m, c in every.choices.items()} == {64: Outcome.HIT,
                                                                  128: Outcome.HIT}
    only = ShapePlan.build(dispatcher, shape, WeightLayout.PLAIN, deterministic=True)
    varying, ordered = only.choices[64], only.choices[128]
    assert varying.outcome is Outcome.FALLBACK and varying.kernel is None
    assert varying.refused == "nondeterministic" and "REDUCE=atomic_out" in varying.reason
    assert ordered.outcome is Outcome.HIT and ordered.kernel == "moetune_grouped"
    assert only.lookup(70)[0] is varying  # its num_tokens do not go to the neighbour's winner


def test_lookup_says_what_deterministic_serving_runs(top8_table, monkeypatch):
    path, _ = top8_table
    args = ["lookup", "--table", str(path), "--sku", "nvidia:H200", "--num-tokens", "64",
            "--hidden", "2048", "--intermediate", "768", "--experts", "128", "--topk", "8",
            "--dtype", "bfloat16"]
    monkeypatch.delenv("MOETUNE_DETERMINISTIC", raising=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    fast = CliRunner().invoke(app, args)
    assert fast.exit_code == 0, fast.output
    assert "pick:    moetune_grouped" in fast.output
    assert "repeats: REDUCE=atomic_out adds 8 partial rows" in fast.output
    monkeypatch.setenv("MOETUNE_DETERMINISTIC", "1")
    only = CliRunner().invoke(app, args)
    assert only.exit_code == 0, only.output
    assert "pick:    vLLM's own kernel" in only.output and "counted: fallback" in only.output
    assert "MOETUNE_DETERMINISTIC=1" in only.output
    ordered = CliRunner().invoke(app, [*args[:6], "128", *args[7:]])
    assert "repeats: the same bits in every call" in ordered.output


def test_show_marks_served_what_deterministic_serving_runs(top8_table, tmp_path, monkeypatch):
    """The same winners in a table for this CPU: under MOETUNE_DETERMINISTIC=1 show says the
    varying one is not served, with the reason the plan gives, and the ordered one is."""
    path, shape = top8_table
    plan = ShapePlan.build(Dispatcher.load(path, H200, check_environment=False), shape,
                           WeightLayout.PLAIN, deterministic=True)
    here = tmp_path / "cpu.db"
    write_winners(here, shape, [64], "moetune_grouped", grouped(shape.problem(64), "atomic_out"))
    write_winners(here, shape, [128], "moetune_grouped", grouped(shape.problem(128), "sum"))

    def served() -> dict[int, tuple[bool, str]]:
        result = CliRunner().invoke(app, ["show", str(here), "--json", "--device", "cpu"])
        assert result.exit_code == 0, result.output
        rows = [json.loads(line) for line in result.output.strip().splitlines()]
        return {r["num_tokens"]: (r["served"], r["served_reason"]) for r in rows}

    for name in ("MOETUNE_MODE", "MOETUNE_DETERMINISTIC", "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    assert {m: ok for m, (ok, _) in served().items()} == {64: True, 128: True}
    monkeypatch.setenv("MOETUNE_DETERMINISTIC", "1")
    only = served()
    assert only[64] == (False, plan.choices[64].reason) and "REDUCE=atomic_out" in only[64][1]
    assert only[128][0]
    grid = CliRunner().invoke(app, ["show", str(here), "--device", "cpu"]).output
    assert "no: MOETUNE_DETERMINISTIC=1" in grid and "yes" in grid


def test_the_setting_is_0_or_1():
    assert not Settings.from_env({}).deterministic
    assert Settings.from_env({"MOETUNE_DETERMINISTIC": "1"}).deterministic
    with pytest.raises(InvalidProblemError, match="MOETUNE_DETERMINISTIC='yes': 0 or 1"):
        Settings.from_env({"MOETUNE_DETERMINISTIC": "yes"})
