"""The search, the gate and the confirmation round, on real CPU kernels and Optuna."""

import dataclasses
import json
import subprocess
import sqlite3
from typing import Any

import pytest
import torch

from moetune import db
from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights, Param, params_key
from moetune.runtime.kernels.torch_dense import TorchDenseKernel
from moetune.runtime.kernels.torch_grouped import TorchGroupedKernel
from moetune.runtime.dispatcher import row_verdict
from moetune.runtime.platform import environment
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import KERNEL_PATHS, Registry, default_registry
from moetune.runtime.rules import rule_choice, rule_variants
from moetune.tuner.confirm import confirm
from moetune.tuner.job import JobOptions, run_job
from moetune.tuner.measure import Measurer, Status
from moetune.tuner.bucket import _earlier_variants, _known_results, _neighbour_winners
from moetune.tuner.search import search


class AnyDeviceKernel(BaseKernel):
    """Test kernels run wherever the tests do."""

    @classmethod
    def _supports_device(cls, problem, sku):
        return None


class FastButWrongKernel(AnyDeviceKernel):
    """Returns zeros instantly: the fastest kernel there is, and wrong."""

    name = "fast_but_wrong"

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        return lambda x, w, ids: torch.zeros_like(x)


class PartialWriteKernel(AnyDeviceKernel):
    """Leaves the last row unwritten (uninitialised memory), as a buggy tiled kernel would."""

    name = "partial_write"

    @classmethod
    def prepare(cls, problem, params, weights):
        ref = TorchDenseKernel.prepare(problem, {"chunk_tokens": 512}, weights)

        def run(x, w, ids):
            out = torch.empty_like(x)
            out[:-1] = ref(x, w, ids)[:-1]
            return out

        return run


class CrashingKernel(AnyDeviceKernel):
    name = "crashing"

    @classmethod
    def prepare(cls, problem, params, weights):
        def run(x, w, ids):
            raise RuntimeError("out of resources: shared memory\nsecond line")
        return run


def registry_with(*kernels) -> Registry:
    reg = Registry()
    for k in kernels:
        reg.add(k)
    return reg


def test_wrong_and_crashing_kernels_are_recorded_and_never_win(small_problem, cpu_sku):
    reg = registry_with(FastButWrongKernel, CrashingKernel, PartialWriteKernel)
    measurer = Measurer(small_problem, "cpu", reg, reps=3)
    results = search(small_problem, cpu_sku, measurer, reg.candidates(small_problem, cpu_sku),
                     trials=40)
    by_kernel = {k: r for (k, _), r in results.items()}
    assert by_kernel["fast_but_wrong"].status is Status.WRONG
    assert by_kernel["crashing"].status is Status.FAILED
    assert by_kernel["crashing"].reason == "RuntimeError: out of resources: shared memory"
    baseline = rule_choice(small_problem, cpu_sku).kernel  # vllm_cpu_experts where vLLM runs
    assert by_kernel[baseline].status is Status.OK  # the rule's pick is always measured
    decision = confirm(small_problem, cpu_sku, measurer, results, rounds=2, reps=3)
    assert decision.winner.kernel not in {"fast_but_wrong", "crashing", "partial_write"}
    assert decision.baseline.kernel == baseline


def test_poisoned_memory_catches_a_kernel_that_skips_outputs(small_problem):
    reg = registry_with(PartialWriteKernel)
    measurer = Measurer(small_problem, "cpu", reg, reps=3)
    reference = reg.get("reference").prepare(small_problem, {}, measurer.weights)
    for _ in range(50):  # a correct output of the same size, freed just before: reusable memory
        reference(*measurer.check.args()).clone()
        assert measurer.measure("partial_write", {}).status is Status.WRONG


def test_search_covers_a_small_space_once_and_stops(small_problem, cpu_sku):
    reg = Registry()
    measurer = Measurer(small_problem, "cpu", reg, reps=2)
    calls = []
    original = measurer.measure
    measurer.measure = lambda k, p, c=None: calls.append((k, tuple(p.items()))) or original(k, p, c)
    cands = reg.candidates(small_problem, cpu_sku)
    results = search(small_problem, cpu_sku, measurer, cands, trials=200)
    space = sum(k.space_size() for k in cands)
    assert len(results) == space == len(calls) == len(set(calls))  # no config measured twice


def test_job_writes_every_bucket_and_resumes_without_remeasuring(tmp_path, cpu_sku):
    problems = [MoEProblem(m, 64, 96, 8, 2, dtype="float32") for m in (1, 32)]
    path = tmp_path / "t.db"
    opts = JobOptions(device="cpu", trials=6, reps=3)
    first = run_job(problems, path, cpu_sku, opts)
    assert [o.error for o in first] == [None, None] and all(o.measured > 0 for o in first)
    for o in first:  # where the time went: the phases lie inside the bucket's wall time
        s = o.seconds
        assert s["timing"] > 0 and s["first_calls"] > 0 and s["compile_ahead"] == 0
        assert s["total"] >= s["setup"] + s["first_calls"] + s["timing"] + s["confirm"]
    snapshot = db.read_winners(path)
    assert sorted(r.bucket["num_tokens"] for r in snapshot.rows) == [1, 32]
    for row in snapshot.rows:
        rule = rule_choice(MoEProblem.from_row(row.bucket), cpu_sku)
        assert row.baseline_kernel == rule.kernel and row.baseline_us > 0
        assert row.error is not None and row.error <= 1e-4
    second = run_job(problems, path, cpu_sku, opts)
    assert all(o.reused == first[i].measured for i, o in enumerate(second))
    assert sum(o.measured for o in second) < sum(o.measured for o in first)
    assert len(db.read_winners(path).rows) == 2


class DenseBefore(AnyDeviceKernel):
    """A kernel as an older moetune declared it; ``DenseAfter`` is the same kernel once it
    gained a parameter whose default is what it computed before."""

    name = "dense_grown"
    params = (Param("chunk_tokens", (8, 32, 128)),)

    @classmethod
    def prepare(cls, problem, params, weights):
        return TorchDenseKernel.prepare(problem, {"chunk_tokens": params["chunk_tokens"]}, weights)


class DenseAfter(DenseBefore):
    params = DenseBefore.params + (Param("unroll", (0, 1), default=0),)


def test_trials_stored_before_a_kernel_gained_a_parameter_are_reused_at_its_default(
        tmp_path, small_problem, cpu_sku):
    path = tmp_path / "t.db"
    opts = JobOptions(device="cpu", trials=8, reps=3)
    run_job([small_problem], path, cpu_sku, opts, registry=registry_with(DenseBefore))
    writer = db.TableWriter(path)
    before = {json: m for (kernel, json), m in
              writer.measurements(cpu_sku.to_row(), small_problem.to_row()).items()
              if kernel == "dense_grown"}
    assert before and all("unroll" not in m.params for m in before.values())

    known, runs = _known_results(writer, cpu_sku, small_problem, registry_with(DenseAfter))
    grown = {key: r for key, r in known.items() if key[0] == "dense_grown"}
    assert len(grown) == len(before)
    assert all(r.params["unroll"] == 0 and key == ("dense_grown", params_key(r.params))
               for key, r in grown.items())
    assert set(runs) == set(known)
    # A kernel no longer registered: its trials cannot be reproduced, so none is known.
    assert not _known_results(writer, cpu_sku, small_problem, Registry({}))[0]

    # Re-tuned by today's kernel: the stored points are not timed again.
    run_job([small_problem], path, cpu_sku, opts, registry=registry_with(DenseAfter))
    after = writer.measurements(cpu_sku.to_row(), small_problem.to_row())
    chunks = {m.params["chunk_tokens"] for m in before.values()}
    retimed = [m for (kernel, _), m in after.items() if kernel == "dense_grown"
               and m.params.get("unroll") == 0 and m.params["chunk_tokens"] in chunks]
    assert not retimed


class ProcessKillingKernel(AnyDeviceKernel):
    """Takes its whole process down, as a kernel that corrupts the CUDA context would."""

    name = "process_killing"

    @classmethod
    def prepare(cls, problem, params, weights):
        def run(x, w, ids):
            import os
            os._exit(3)
        return run


def test_isolated_worker_survives_a_candidate_that_kills_its_process(small_problem):
    from moetune.tuner.procs.measurer import IsolatedMeasurer

    reg = registry_with(ProcessKillingKernel)
    measurer = IsolatedMeasurer(small_problem, "cpu", reg, reps=2, timeout_s=120)
    try:
        dead = measurer.measure("process_killing", {})
        assert dead.status is Status.FAILED and "exit code 3" in dead.reason
        fine = measurer.measure("torch_loop", {})
        assert fine.status is Status.OK and fine.median_us > 0
        assert measurer.restarts == 1
        assert measurer.retime("torch_loop", {}, 2).median_us > 0
    finally:
        measurer.close()


class ScriptedMeasurer:
    """Re-timing answers from a script, one per round, so the confirmation rule is tested
    without real noise: ``timings[kernel]`` is a list of (median, spread), cycled."""

    def __init__(self, timings):
        self.timings = timings
        self.calls = {k: 0 for k in timings}

    def retime(self, kernel, params, reps):
        from moetune.tuner.timing import Timing
        script = self.timings[kernel]
        median, spread = script[self.calls[kernel] % len(script)]
        self.calls[kernel] += 1
        return Timing(median, median - spread, median + spread, reps, "scripted")


def _ok(kernel, us):
    from moetune.tuner.measure import Result
    from moetune.tuner.timing import Timing
    return Result(kernel, {}, Status.OK, Timing(us, us, us, 1, "x"), 0.0)


def test_confirmation_gives_near_ties_to_the_baseline_and_real_wins_to_the_winner(
        small_problem, cpu_sku):
    base = rule_choice(small_problem, cpu_sku).kernel
    results = {(base, "{}"): _ok(base, 100.0),
               ("torch_grouped", "{}"): _ok("torch_grouped", 90.0)}
    # Faster in the median round, but slower in two of five: not a win.
    tie = confirm(small_problem, cpu_sku, ScriptedMeasurer(
        {base: [(100.0, 1.0), (85.0, 1.0), (115.0, 1.0), (88.0, 1.0), (112.0, 1.0)],
         "torch_grouped": [(90.0, 1.0)]}), results)
    assert tie.winner.kernel == base and "near-tie" in tie.reason
    assert not tie.baseline.beaten
    win = confirm(small_problem, cpu_sku, ScriptedMeasurer(
        {base: [(100.0, 5.0)], "torch_grouped": [(50.0, 1.0)]}), results)
    assert win.winner.kernel == "torch_grouped" and win.speedup == 2.0
    # Rounds that agree exactly still carry the error the timings' own repetitions imply.
    assert win.baseline.beaten and 1.01 < win.baseline.ratio_lo < 2.0 < win.baseline.ratio_hi


@pytest.mark.parametrize("slow_rounds", [1, 2])
def test_a_baseline_slowed_by_noise_in_some_rounds_never_makes_a_slower_winner(
        small_problem, cpu_sku, slow_rounds):
    """The candidate is truly 10% slower; another process makes the baseline 10-50x slower in
    some rounds (as a busy core did to vLLM's CPU kernel): the baseline must be kept."""
    base = rule_choice(small_problem, cpu_sku).kernel
    results = {(base, "{}"): _ok(base, 100.0),
               ("torch_grouped", "{}"): _ok("torch_grouped", 20.0)}  # a lucky search timing
    noisy = [(100.0, 1.0)] * (5 - slow_rounds) + [(5000.0, 1.0), (1000.0, 1.0)][:slow_rounds]
    decision = confirm(small_problem, cpu_sku, ScriptedMeasurer(
        {base: noisy, "torch_grouped": [(110.0, 1.0)]}), results)
    assert decision.winner.kernel == base
    assert not decision.baseline.beaten


def test_every_rule_variant_is_recorded_with_the_winners_ratio(small_problem, cpu_sku):
    variants = rule_variants(small_problem, cpu_sku)
    assert [v.kernel for v in variants] == ["vllm_cpu_experts", "torch_loop"] or \
        [v.kernel for v in variants] == ["torch_loop"]
    results = {(v.kernel, "{}"): _ok(v.kernel, 100.0 * (i + 1)) for i, v in enumerate(variants)}
    results[("torch_grouped", "{}")] = _ok("torch_grouped", 50.0)
    script = {v.kernel: [(100.0 * (i + 1), 1.0)] for i, v in enumerate(variants)}
    script["torch_grouped"] = [(50.0, 1.0)]
    decision = confirm(small_problem, cpu_sku, ScriptedMeasurer(script), results)
    assert [b.kernel for b in decision.baselines] == [v.kernel for v in variants]
    assert all(b.ratio_lo < 2.0 * (i + 1) < b.ratio_hi for i, b in enumerate(decision.baselines))
    assert all(b.beaten and b.rounds == 5 for b in decision.baselines)


def test_isolated_job_reuses_one_worker_across_buckets(tmp_path, cpu_sku):
    problems = [MoEProblem(m, 64, 96, 8, 2, dtype="float32") for m in (1, 8)]
    outcomes = run_job(problems, tmp_path / "t.db", cpu_sku,
                       JobOptions(device="cpu", trials=3, reps=2, isolate=True))
    assert [o.error for o in outcomes] == [None, None]
    assert sorted(r.bucket["num_tokens"] for r in db.read_winners(tmp_path / "t.db").rows) == [1, 8]


class JitLikeKernel(AnyDeviceKernel):
    """A kernel the tuner compiles ahead: two configs run, one raises, one kills its process."""

    name = "jit_like"
    compiles = True
    params = (Param("variant", ("fine", "also_fine", "raises", "kills")),)

    @classmethod
    def prepare(cls, problem, params, weights):
        if params["variant"] == "raises":
            raise RuntimeError("out of resources: shared memory, required: 300000")
        ref = TorchDenseKernel.prepare(problem, {"chunk_tokens": 512}, weights)

        def run(x, w, ids):
            if params["variant"] == "kills":
                import os
                os._exit(3)
            return ref(x, w, ids)
        return run


def test_search_compiles_ahead_in_parallel_and_records_compile_failures(small_problem, cpu_sku):
    from moetune.tuner.procs.compile_pool import CompilePool

    reg = registry_with(JitLikeKernel)
    rule = reg.get(rule_choice(small_problem, cpu_sku).kernel)
    pool = CompilePool(small_problem, "cpu", reg, workers=2, timeout_s=120)
    measurer = Measurer(small_problem, "cpu", reg, reps=2)  # in this process: "kills" would end it
    try:
        results = search(small_problem, cpu_sku, measurer, [rule, JitLikeKernel], trials=5,
                         compiler=pool)
    finally:
        pool.close()
    by_variant = {r.params["variant"]: r for r in results.values() if r.kernel == "jit_like"}
    assert set(by_variant) == {"fine", "also_fine", "raises", "kills"}
    assert by_variant["fine"].status is by_variant["also_fine"].status is Status.OK
    assert by_variant["raises"].status is Status.FAILED
    assert by_variant["raises"].reason.startswith("compiling ahead: RuntimeError: out of resources")
    assert by_variant["kills"].status is Status.FAILED and "exit code 3" in by_variant["kills"].reason
    assert sum(c.restarts for c in pool._children) == 1


def _only(rule_kernel: str, *kernels) -> Registry:
    """A registry of the reference, the rule's kernel and ``kernels``: a search space of a few."""
    reg = Registry({n: KERNEL_PATHS[n] for n in ("reference", rule_kernel)})
    for k in kernels:
        reg.add(k)
    return reg


def test_job_with_a_compile_pool_keeps_crashing_candidates_out_of_the_measurer(tmp_path, cpu_sku):
    problems = [MoEProblem(m, 64, 96, 8, 2, dtype="float32") for m in (1, 8)]
    outcomes = run_job(problems, tmp_path / "t.db", cpu_sku,  # measured in this process
                       JobOptions(device="cpu", trials=5, reps=2, compile_workers=2),
                       registry=_only(rule_choice(problems[0], cpu_sku).kernel, JitLikeKernel))
    assert [o.error for o in outcomes] == [None, None]
    failed = {(m["bucket"]["num_tokens"], m["params"]["variant"]): m["reason"]
              for m in db.read_measurements(tmp_path / "t.db")
              if m["kernel"] == "jit_like" and m["status"] == "failed"}
    assert set(failed) == {(m, v) for m in (1, 8) for v in ("raises", "kills")}
    assert all(r.startswith("compiling ahead: ") for r in failed.values())
    assert all(o.seconds["compile_ahead"] > 0 for o in outcomes)
    assert sorted(r.bucket["num_tokens"] for r in db.read_winners(tmp_path / "t.db").rows) == [1, 8]


def test_timing_stops_after_the_probe_only_when_slower_than_the_cutoff():
    import time

    from moetune.tuner.timing import PROBE_REPS, time_op

    def two_ms(x):
        time.sleep(0.002)
        return x

    inputs = [(torch.zeros(1),)] * 2
    slow = time_op(two_ms, inputs, "cpu", warmup=1, reps=12, cutoff_us=1000.0)
    assert slow.samples == PROBE_REPS and slow.method == "cpu-wall-cut" and slow.median_us > 1000
    kept = time_op(two_ms, inputs, "cpu", warmup=1, reps=12, cutoff_us=1e6)
    assert kept.samples == 12 and kept.method == "cpu-wall"


class SleepyKernel(AnyDeviceKernel):
    """Correct, and slower by ``ms`` milliseconds per call: the search cuts the slow ones. 200 ms
    stays far above 1.5x the rule's time even when a busy core slows vLLM's CPU kernel to ~24 ms."""

    name = "sleepy"
    params = (Param("ms", (0, 200)),)

    @classmethod
    def prepare(cls, problem, params, weights):
        import time
        ref = TorchDenseKernel.prepare(problem, {"chunk_tokens": 512}, weights)

        def run(x, w, ids):
            time.sleep(params["ms"] / 1000)
            return ref(x, w, ids)
        return run


def test_search_times_candidates_far_slower_than_the_best_only_roughly(small_problem, cpu_sku):
    from moetune.tuner.timing import PROBE_REPS

    reg = registry_with(SleepyKernel)
    rule = reg.get(rule_choice(small_problem, cpu_sku).kernel)
    results = search(small_problem, cpu_sku, Measurer(small_problem, "cpu", reg, reps=10),
                     [rule, SleepyKernel], trials=3)
    slow = next(r for r in results.values() if r.kernel == "sleepy" and r.params["ms"] == 200)
    fast = next(r for r in results.values() if r.kernel == rule.name)
    assert slow.status is Status.OK and slow.timing.samples == PROBE_REPS
    assert slow.reason.startswith("timing cut after 3 reps")
    assert fast.timing.samples == 10 and fast.reason is None


def test_a_compile_pool_that_cannot_start_leaves_candidates_to_the_measurer(small_problem):
    """A pool worker that dies setting up (say its GPU is out of memory) blames no candidate."""
    from moetune.tuner.procs.compile_pool import CompilePool

    pool = CompilePool(small_problem, "no-such-device", Registry(), workers=1, timeout_s=120)
    try:
        assert pool.compile([("torch_loop", {})]) == [None]
        assert not pool._children[0].alive  # it did die: the None is not a compile that ran
    finally:
        pool.close()


def test_compile_workers_default_to_half_the_cores_on_cuda_only(monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert JobOptions(device="cuda").compilers == 8 and JobOptions(device="cpu").compilers == 0
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert JobOptions(device="cuda:1").compilers == 8
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert JobOptions(device="cuda").compilers == 0  # one worker would only add a process
    assert JobOptions(device="cuda", compile_workers=3).compilers == 3


def test_a_job_on_several_devices_tunes_every_bucket_once_into_one_table(tmp_path, cpu_sku):
    """Buckets go to whichever device is free; the table gets each once, from one run."""
    problems = [MoEProblem(m, 64, 96, 8, 2, dtype="float32") for m in (1, 2, 4, 8, 16, 24)]
    import threading

    lanes = []
    outcomes = run_job(problems, tmp_path / "t.db", cpu_sku,
                       JobOptions(device="cpu", devices=("cpu", "cpu"), trials=3, refine=0, reps=2),
                       on_bucket=lambda o: lanes.append(threading.current_thread().name))
    assert [o.problem for o in outcomes] == problems and [o.error for o in outcomes] == [None] * 6
    assert len(lanes) == 6 and len(set(lanes)) == 2  # both devices took buckets
    assert {o.device for o in outcomes} == {"cpu"}
    snapshot = db.read_winners(tmp_path / "t.db")
    assert sorted(r.bucket["num_tokens"] for r in snapshot.rows) == [1, 2, 4, 8, 16, 24]
    assert {r.run_id for r in snapshot.rows} == {1}
    assert len(db.read_measurements(tmp_path / "t.db")) == sum(o.measured for o in outcomes)


def test_gpus_needs_cuda_and_that_many_gpus():
    from typer.testing import CliRunner

    from moetune.cli import app

    result = CliRunner().invoke(app, ["tune", "--output", "x.db", "--preset", "tiny",
                                      "--device", "cpu", "--gpus", "2"])
    assert result.exit_code == 1 and "--gpus needs --device cuda" in result.output


def test_skip_tuned_leaves_buckets_with_a_current_measured_winner(tmp_path, cpu_sku):
    problems = [MoEProblem(m, 64, 96, 8, 2, dtype="float32") for m in (1, 8)]
    path = tmp_path / "t.db"
    run_job(problems[:1], path, cpu_sku, JobOptions(device="cpu", trials=3, reps=2))
    again = run_job(problems, path, cpu_sku,
                    JobOptions(device="cpu", trials=3, reps=2, skip_tuned=True))
    assert again[0].skipped.startswith("already tuned (run 1: ") and again[0].measured == 0
    assert again[1].skipped is None and again[1].decision is not None
    assert {r.bucket["num_tokens"]: r.run_id for r in db.read_winners(path).rows} == {1: 1, 8: 2}


def test_skip_tuned_re_tunes_buckets_measured_under_other_versions(tmp_path, cpu_sku):
    """A row timed under another torch says nothing here: ``--skip-tuned`` tunes its bucket
    again, and leaves the bucket measured in this environment."""
    problems = [MoEProblem(m, 64, 96, 8, 2, dtype="float32") for m in (1, 8)]
    path = tmp_path / "t.db"
    run_job(problems[:1], path, cpu_sku, JobOptions(device="cpu", trials=3, reps=2))
    run_job(problems[1:], path, cpu_sku, JobOptions(device="cpu", trials=3, reps=2))
    with sqlite3.connect(path) as con:
        con.execute("UPDATE tuning_run SET environment = json_set(environment, '$.torch', "
                    "'1.13.1') WHERE id = 1")
    again = run_job(problems, path, cpu_sku,
                    JobOptions(device="cpu", trials=3, reps=2, skip_tuned=True))
    assert again[0].skipped is None and again[0].decision is not None
    assert again[1].skipped.startswith("already tuned (run 2: ")
    assert {r.bucket["num_tokens"]: r.run_id for r in db.read_winners(path).rows} == {1: 3, 8: 2}


@pytest.mark.parametrize("stale", [
    "UPDATE tuning_run SET environment = json_set(environment, '$.torch', '1.13.1')",
    """UPDATE winner SET baselines = '{"variants":[]}'""",  # timed against another rule
])
def test_reconfirm_re_times_the_tables_winner_and_the_rule_instead_of_searching(
        tmp_path, cpu_sku, stale):
    """A bucket whose row was timed under another torch, or against a rule not picked here, is
    decided again from that row's winner and the rule variants alone: a winner no longer faster
    gives the bucket back to the rule's pick, and the new row, timed here, is served here."""
    problem = MoEProblem(8, 64, 96, 8, 2, dtype="float32")
    rule = rule_choice(problem, cpu_sku)
    registry = _only(rule.kernel, NeedleKernel)
    path = tmp_path / "t.db"
    run_job([problem], path, cpu_sku, JobOptions(device="cpu", trials=2, refine=0, reps=2),
            registry=registry)
    slow = {"a": 1, "b": 2}  # sleeps 20 ms a call; the search would have measured its seed
    with sqlite3.connect(path) as con:
        con.execute("UPDATE winner SET kernel = 'needle', params = ?", (json.dumps(slow),))
        con.execute(stale)
    [old] = db.read_winners(path).rows
    assert row_verdict(old, cpu_sku, registry, environment()).stale

    [o] = run_job([problem], path, cpu_sku,
                  JobOptions(device="cpu", trials=2, refine=0, reps=2, reconfirm=True,
                             skip_tuned=True), registry=registry)
    assert o.reconfirmed == 1 and o.reused == 0
    with sqlite3.connect(path) as con:
        timed = {(k, params_key(json.loads(p))) for k, p in con.execute(
            "SELECT kernel, params FROM measurement WHERE run_id = 2")}
    variants = {(v.kernel, params_key(v.params)) for v in rule_variants(problem, cpu_sku)
                if v.kernel in registry.names()}
    assert timed == variants | {("needle", params_key(slow))} and o.measured == len(timed)
    [row] = db.read_winners(path).rows
    assert row.run_id == 2 and (row.kernel, row.params) == (rule.kernel, rule.params)
    assert row_verdict(row, cpu_sku, registry, environment()).selection is not None


def test_reconfirm_searches_buckets_the_table_has_no_winner_for(tmp_path, cpu_sku):
    problem = MoEProblem(8, 64, 96, 8, 2, dtype="float32")
    registry = _only(rule_choice(problem, cpu_sku).kernel, NeedleKernel)
    [o] = run_job([problem], tmp_path / "t.db", cpu_sku,
                  JobOptions(device="cpu", trials=2, refine=0, reps=2, reconfirm=True),
                  registry=registry)
    assert o.reconfirmed is None and o.decision is not None
    assert any(r.kernel == "needle" for r in o.decision.results)  # its seed: a search ran


def test_deterministic_job_searches_again_where_the_winner_varies(tmp_path, cpu_sku):
    """``--reconfirm --deterministic``: a bucket whose winner's bits may change between calls
    is searched among the configurations that do not vary, not re-confirmed."""
    problem = MoEProblem(8, 64, 96, 8, 2, dtype="float32")
    registry = _only(rule_choice(problem, cpu_sku).kernel, VaryingNeedleKernel)
    path = tmp_path / "t.db"
    run_job([problem], path, cpu_sku, JobOptions(device="cpu", trials=2, refine=0, reps=2),
            registry=registry)
    needle = VaryingNeedleKernel.NEEDLE
    with sqlite3.connect(path) as con:
        con.execute("UPDATE winner SET kernel = 'needle', params = ?", (json.dumps(needle),))
    opts = JobOptions(device="cpu", trials=2, refine=0, reps=2, reconfirm=True)
    [o] = run_job([problem], path, cpu_sku, dataclasses.replace(opts, deterministic=True),
                  registry=registry)
    assert o.reconfirmed is None and o.decision is not None
    assert all(r.params != needle for r in o.decision.results if r.status is Status.OK)
    [again] = run_job([problem], path, cpu_sku, opts, registry=registry)
    assert again.reconfirmed is not None  # without --deterministic it is re-confirmed


def test_deterministic_job_does_not_skip_a_bucket_whose_winner_varies(tmp_path, cpu_sku,
                                                                     monkeypatch):
    problem = MoEProblem(8, 64, 96, 8, 2, dtype="float32")
    path = tmp_path / "t.db"
    opts = JobOptions(device="cpu", trials=2, refine=0, reps=2, skip_tuned=True)
    run_job([problem], path, cpu_sku, opts)
    with sqlite3.connect(path) as con:
        con.execute("UPDATE winner SET kernel = 'torch_grouped', params = '{}'")
    monkeypatch.setattr(TorchGroupedKernel, "run_to_run",
                        classmethod(lambda cls, problem, params: "adds with atomics"))
    assert run_job([problem], path, cpu_sku, opts)[0].skipped.startswith("already tuned")
    [o] = run_job([problem], path, cpu_sku, dataclasses.replace(opts, deterministic=True))
    assert o.skipped is None and o.decision.winner.kernel != "torch_grouped"


class NeedleKernel(AnyDeviceKernel):
    """Correct everywhere, 20 ms slower everywhere but at one point of 16 (not its seed)."""

    name = "needle"
    params = (Param("a", tuple(range(4))), Param("b", tuple(range(4))))
    NEEDLE = {"a": 3, "b": 1}

    @classmethod
    def seed_params(cls, problem, sku):
        return {"a": 0, "b": 0}

    @classmethod
    def prepare(cls, problem, params, weights):
        import time
        ref = TorchDenseKernel.prepare(problem, {"chunk_tokens": 512}, weights)
        slow = params != cls.NEEDLE

        def run(x, w, ids):
            if slow:
                time.sleep(0.02)
            return ref(x, w, ids)
        return run


def test_a_bucket_search_measures_the_starts_it_is_given(small_problem, cpu_sku):
    """A start the sampler would not reach on a budget of one trial is measured; one of a
    kernel that is no candidate here is left out."""
    registry = _only(rule_choice(small_problem, cpu_sku).kernel, NeedleKernel)
    measurer = Measurer(small_problem, "cpu", registry, reps=2)
    cands = registry.candidates(small_problem, cpu_sku)
    results = search(small_problem, cpu_sku, measurer, cands, trials=1, refine=0,
                     starts=[("needle", NeedleKernel.NEEDLE), ("not_a_candidate", {})])
    needle = results[("needle", params_key(NeedleKernel.NEEDLE))]
    assert needle.status is Status.OK
    assert len(results) <= 3  # the rule's pick, the needle's seed and the start


def _winner(problem: MoEProblem, sku_row: dict, params: dict, source: str = "measured"):
    return db.WinnerRecord(sku_row, problem.to_row(), "needle", params, 1.0, 1.0, 1.0, 0.0,
                           "vllm_cpu_experts", {}, 2.0, 2.0, 1, source)


def test_neighbouring_winners_are_the_nearest_of_the_same_shape_and_device(cpu_sku):
    shape = MoEProblem(16, 64, 96, 8, 2, dtype="float32")
    at = lambda m, **change: dataclasses.replace(shape, num_tokens=m, **change)
    here, there = cpu_sku.to_row(), {**cpu_sku.to_row(), "name": "another CPU"}
    rows = [_winner(at(4), here, {"a": 0, "b": 0}), _winner(at(8), here, {"a": 1, "b": 0}),
            _winner(at(12, hidden_size=128), here, {"a": 2, "b": 0}),  # another shape
            _winner(at(12), there, {"a": 2, "b": 1}),  # another device
            _winner(at(14), here, {"a": 2, "b": 2}, source="vllm-json"),  # not measured here
            _winner(at(15), here, {"a": 9, "b": 0}),  # outside today's space
            _winner(at(32), here, {"a": 3, "b": 0}), _winner(at(64), here, {"a": 3, "b": 3})]
    registry = _only(rule_choice(shape, cpu_sku).kernel, NeedleKernel)
    assert _neighbour_winners(rows, cpu_sku, shape, registry) == [
        ("needle", {"a": 1, "b": 0}), ("needle", {"a": 3, "b": 0})]
    assert _neighbour_winners(rows, cpu_sku, at(2), registry) == [("needle", {"a": 0, "b": 0})]
    assert _neighbour_winners(rows, cpu_sku, at(16, topk=4), registry) == []


def test_source_commit_names_the_checkout_and_marks_modified_files(tmp_path):
    """Provenance: the commit a table names is the code that tuned it, or it says it was not."""
    from moetune.tuner.job import source_commit

    assert source_commit(tmp_path) is None  # not a checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "kernel.py").write_text("A = 1\n")
    subprocess.run([*git, "add", "kernel.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "notes.txt").write_text("untracked files are not the code\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "probe.py").write_text("nor scripts beside the packages\n")
    assert source_commit(tmp_path) == head
    (tmp_path / "runtime" / "kernels").mkdir(parents=True)
    (tmp_path / "runtime" / "kernels" / "new.py").write_text("B = 1\n")  # not committed yet
    assert source_commit(tmp_path) == f"{head}+modified"
    assert source_commit(tmp_path / "scripts") == f"{head}+modified"  # from inside it too
    (tmp_path / "runtime" / "kernels" / "new.py").unlink()
    assert source_commit(tmp_path / "scripts") == head
    (tmp_path / "kernel.py").write_text("A = 2\n")
    assert source_commit(tmp_path) == f"{head}+modified"


def test_a_reconfirmed_row_keeps_the_variants_it_did_not_time_while_its_winner_stands(cpu_sku):
    """Re-confirming against today's rule keeps the earlier row's other variants (another
    vLLM's pick, measured then) where the winner is unchanged, so machines whose rule is one of
    them keep serving the row; a new winner drops them (their verdicts were on the old one)."""
    problem = MoEProblem(8, 64, 96, 8, 2, dtype="float32")
    rule = rule_choice(problem, cpu_sku)
    old = db.BaselineRecord(db.Candidate(rule.kernel, rule.params), "0.31.0", None, 90.0,
                            beaten=True)
    timed = (db.BaselineRecord(db.Candidate(rule.kernel, rule.params), rule.vllm, rule.configs,
                               100.0),)
    winner = db.Candidate("torch_dense", {"chunk_tokens": 512})
    row = db.WinnerRecord(cpu_sku.to_row(), problem.to_row(), winner.kernel, winner.params, 50.0,
                          49.0, 51.0, 0.0, rule.kernel, rule.params, 90.0, 1.8, 1,
                          baselines=(old, *timed))
    assert _earlier_variants([row], cpu_sku, problem, default_registry, winner, timed) == (old,)
    other = db.Candidate("torch_grouped", {})
    assert _earlier_variants([row], cpu_sku, problem, default_registry, other, timed) == ()
    elsewhere = dataclasses.replace(row, bucket=problem.with_tokens(16).to_row())
    assert _earlier_variants([elsewhere], cpu_sku, problem, default_registry, winner, timed) == ()


class VaryingNeedleKernel(NeedleKernel):
    """``needle`` whose fast point adds with atomics."""

    @classmethod
    def run_to_run(cls, problem, params):
        return "adds with atomics" if params == cls.NEEDLE else None

