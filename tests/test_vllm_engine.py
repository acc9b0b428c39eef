"""The plugin inside vLLM's real engine on the CPU, with tiny random MoE models made here.

Each scenario runs ``tests/vllm_driver.py`` in a fresh process (vLLM reads the MOETUNE_* settings
once per process) and compares greedy outputs with a run where the plugin is off. The models are
float32, so moetune's torch kernels and vLLM's CPU kernel agree to ~1e-6: the tokens must be the
same and every chosen token's logprob within ``LOGPROB_TOL``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moetune.runtime.problem import MoEProblem
from moetune.runtime.rules import rule_choice

from tests.vllm_tables import model_shape, tiny_model, write_winners

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (bash scripts/setup.sh --vllm)"),
]

DRIVER = Path(__file__).with_name("vllm_driver.py")
LOGPROB_TOL = 1e-4
HIT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 4096)


class Run:
    """One engine run: exit code, combined log, the driver's JSON and the stats files."""

    def __init__(self, rc: int, log: str, result: dict[str, Any] | None,
                 stats: list[dict[str, Any]]) -> None:
        self.rc, self.log, self.result, self.stats = rc, log, result, stats

    @property
    def worker_stats(self) -> dict[str, Any]:
        """The stats of the one process that ran MoE layers."""
        ran = [s for s in self.stats if s["counters"]]
        assert len(ran) == 1, (self.stats, self.log[-3000:])
        return ran[0]

    def moetune_lines(self, level: str = "") -> list[str]:
        return [line for line in self.log.splitlines()
                if "[moetune]" in line and line.startswith(level)]


def run_engine(model: Path, workdir: Path, *, in_process: bool = True, compile_model: bool = False,
               **env: str) -> Run:
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "result.json"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MOETUNE_")}
    full_env.update(VLLM_CPU_KVCACHE_SPACE="1", MOETUNE_STATS=str(workdir / "stats-{pid}.json"),
                    **env)
    args = [sys.executable, str(DRIVER), str(model), str(out)]
    args += ["--in-process"] * in_process + ["--compile"] * compile_model
    proc = subprocess.run(args, env=full_env, cwd=workdir, capture_output=True, text=True,
                          check=False, timeout=400)
    result = json.loads(out.read_text()) if out.exists() else None
    stats = [json.loads(p.read_text()) for p in sorted(workdir.glob("stats-*.json"))]
    return Run(proc.returncode, proc.stdout + proc.stderr, result, stats)


def assert_same_generation(run: Run, baseline: Run) -> None:
    assert run.rc == 0, run.log[-3000:]
    assert run.result["tokens"] == baseline.result["tokens"]
    for got, want in zip(run.result["logprobs"], baseline.result["logprobs"]):
        assert max(abs(a - b) for a, b in zip(got, want)) < LOGPROB_TOL


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: tiny_model(name, root / name) for name in ("mixtral", "qwen3_moe")}


@pytest.fixture(scope="module")
def baselines(models, tmp_path_factory) -> dict[str, Run]:
    """Each model generated with the plugin off: vLLM's own MoE kernel everywhere."""
    root = tmp_path_factory.mktemp("baseline")
    runs = {name: run_engine(path, root / name, MOETUNE_MODE="off")
            for name, path in models.items()}
    for run in runs.values():
        assert run.rc == 0, run.log[-3000:]
        assert any("MOETUNE_MODE=off" in line for line in run.moetune_lines("INFO"))
        assert run.stats == []
    return runs


def test_table_winners_run_in_the_worker_process(models, baselines, tmp_path):
    """vLLM's usual process layout; strict mode, which starts because the table is good."""
    shape = model_shape(models["mixtral"])
    table = write_winners(tmp_path / "t.db", shape, HIT_BUCKETS[:5], "torch_dense",
                          {"chunk_tokens": 32})
    write_winners(table, shape, HIT_BUCKETS[5:], "torch_grouped")
    run = run_engine(models["mixtral"], tmp_path / "run", in_process=False,
                     MOETUNE_TABLE=str(table), MOETUNE_MODE="strict")
    assert_same_generation(run, baselines["mixtral"])
    worker = run.worker_stats
    assert worker["pid"] != run.result["pid"]  # the spawned worker, not the driver process
    assert worker["table"]["usable"] and worker["table"]["rows"] == len(HIT_BUCKETS)
    assert worker["layers"] == 2 and worker["plain_copy_bytes"] > 0
    (counts,) = worker["counters"].values()
    assert counts["hit"] > 0 and counts["miss"] == counts["fallback"] == 0
    hooked = [ln for ln in run.moetune_lines("INFO") if "hooked CPUUnquantizedExperts" in ln]
    assert len(hooked) >= 2  # the driver, the engine core, the worker: every process
    assert not run.moetune_lines("WARNING")


def test_winners_that_are_vllms_own_kernel_run_vllms_apply(models, baselines, tmp_path, cpu_sku):
    """A table tuned here mostly keeps the rule's pick, vLLM's own CPU kernel: those buckets are
    served by vLLM's apply itself, and no plain copy of the experts is kept."""
    shape = model_shape(models["mixtral"])
    rule = rule_choice(shape.problem(1), cpu_sku)
    assert rule.kernel == "vllm_cpu_experts"  # vLLM is installed: the rule is vLLM's kernel
    table = write_winners(tmp_path / "t.db", shape, HIT_BUCKETS, rule.kernel, rule.params)
    run = run_engine(models["mixtral"], tmp_path / "run", MOETUNE_TABLE=str(table))
    assert_same_generation(run, baselines["mixtral"])
    worker = run.worker_stats
    assert worker["layers"] == 2 and worker["plain_copy_bytes"] == 0
    (counts,) = worker["counters"].values()
    assert counts["hit"] > 0 and counts["miss"] == counts["fallback"] == 0


def test_second_architecture_qwen3_moe(models, baselines, tmp_path):
    shape = model_shape(models["qwen3_moe"])
    table = write_winners(tmp_path / "t.db", shape, (1, 2, 4, 8), "torch_loop")
    write_winners(table, shape, (16, 32, 64), "torch_dense", {"chunk_tokens": 8})
    run = run_engine(models["qwen3_moe"], tmp_path / "run", MOETUNE_TABLE=str(table))
    assert_same_generation(run, baselines["qwen3_moe"])
    counts = run.worker_stats["counters"]
    assert list(counts) == ["H=128 I=64 E=16 topk=4 float32 none silu"]
    assert counts["H=128 I=64 E=16 topk=4 float32 none silu"]["hit"] > 0


def test_torch_compiled_model_runs_winners_through_the_custom_op(models, baselines, tmp_path):
    """vLLM traces the CPU MoE layer with torch.compile(fullgraph); the hook must not break it."""
    shape = model_shape(models["mixtral"])
    table = write_winners(tmp_path / "t.db", shape, HIT_BUCKETS, "torch_grouped")
    run = run_engine(models["mixtral"], tmp_path / "run", compile_model=True,
                     MOETUNE_TABLE=str(table))
    assert_same_generation(run, baselines["mixtral"])
    (counts,) = run.worker_stats["counters"].values()
    assert counts["hit"] > 0 and counts["miss"] == counts["fallback"] == 0


def test_corrupt_table_keeps_serving_with_one_warning(models, baselines, tmp_path):
    table = tmp_path / "corrupt.db"
    table.write_bytes(b"this is not a table" * 64)
    run = run_engine(models["mixtral"], tmp_path / "run", MOETUNE_TABLE=str(table))
    assert_same_generation(run, baselines["mixtral"])
    (warning,) = run.moetune_lines("WARNING")
    assert "not used" in warning and str(table) in warning
    (counts,) = run.worker_stats["counters"].values()
    assert counts["hit"] == 0 and counts["miss"] > 0


def test_strict_refuses_a_table_for_another_sku(models, tmp_path, cpu_sku):
    import dataclasses

    other = dataclasses.replace(cpu_sku, name="SOME_OTHER_CPU")
    table = write_winners(tmp_path / "other.db", model_shape(models["mixtral"]), (4,),
                          "torch_grouped", sku=other)
    run = run_engine(models["mixtral"], tmp_path / "run", MOETUNE_TABLE=str(table),
                     MOETUNE_MODE="strict")
    assert run.rc != 0 and run.result is None
    assert "MOETUNE_MODE=strict) refuses to start" in run.log
    assert "SOME_OTHER_CPU" in run.log


def test_record_appends_missed_buckets(models, baselines, tmp_path):
    shape = model_shape(models["mixtral"])
    table = write_winners(tmp_path / "t.db", shape, (4,), "torch_grouped")
    misses = tmp_path / "misses.jsonl"
    run = run_engine(models["mixtral"], tmp_path / "run", MOETUNE_TABLE=str(table),
                     MOETUNE_MODE="record", MOETUNE_MISSES=str(misses))
    assert_same_generation(run, baselines["mixtral"])
    lines = misses.read_text().splitlines()
    problems = [MoEProblem.from_row(json.loads(line)) for line in lines]
    assert len(set(lines)) == len(lines)
    assert all(p.shape == shape and p.bucket() == p for p in problems)
    buckets = {p.num_tokens for p in problems}
    # The 4 prompts (37 tokens) are prefilled together; decode steps run 4 tokens, tuned.
    assert 32 in buckets and 4 not in buckets
