"""The plugin inside vLLM's real engine on the CPU, with tiny random MoE models made here.

Each scenario runs ``tests/vllm_driver.py`` in a fresh process (vLLM reads the MOETUNE_* settings
once per process) and compares greedy outputs with a run where the plugin is off. The models are
float32, so moetune's torch kernels and vLLM's CPU kernel agree to ~1e-6: the tokens must be the
same and every chosen token's logprob within ``LOGPROB_TOL``. fp8 models run in bfloat16 (see
``BF16_LOGPROB_TOL``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moetune.runtime.kernels.vllm_cpu_experts import VllmCpuExpertsKernel
from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.rules import rule_choice
from moetune.tuner.job import JobOptions, run_job

from tests.vllm_tables import fp8_block_model, model_shape, tiny_model, write_winners

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
               dtype: str = "float32", quantization: str | None = None, **env: str) -> Run:
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "result.json"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MOETUNE_")}
    full_env.update(VLLM_CPU_KVCACHE_SPACE="1", MOETUNE_STATS=str(workdir / "stats-{pid}.json"),
                    **env)
    args = [sys.executable, str(DRIVER), str(model), str(out)]
    args += ["--in-process"] * in_process + ["--compile"] * compile_model + ["--dtype", dtype]
    args += ["--quantization", quantization] if quantization else []
    proc = subprocess.run(args, env=full_env, cwd=workdir, capture_output=True, text=True,
                          check=False, timeout=400)
    result = json.loads(out.read_text()) if out.exists() else None
    stats = [json.loads(p.read_text()) for p in sorted(workdir.glob("stats-*.json"))]
    return Run(proc.returncode, proc.stdout + proc.stderr, result, stats)


def assert_same_generation(run: Run, baseline: Run, tol: float = LOGPROB_TOL) -> None:
    """Greedy tokens and their logprobs match the baseline's within ``tol``. A prompt may part
    only at a near-tie: where the baseline ranked the run's token second, less than ``tol``
    below its own (two kernels' roundings in bf16 may order such a pair either way); what
    follows a different token is not compared."""
    assert run.rc == 0, run.log[-3000:]
    for prompt, (got, want) in enumerate(zip(run.result["tokens"], baseline.result["tokens"])):
        assert len(got) == len(want), prompt
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        logprobs = zip(run.result["logprobs"][prompt][:same],
                       baseline.result["logprobs"][prompt][:same])
        assert all(abs(a - b) < tol for a, b in logprobs), (prompt, got, want)
        if same < len(want):
            top = baseline.result["top2"][prompt][same]
            gap = top[str(want[same])] - top.get(str(got[same]), float("-inf"))
            assert gap < tol, f"prompt {prompt} parts at step {same} ({got} vs {want}): gap {gap}"


def _generation(tokens: list[int], logprobs: list[float],
                top2: list[dict[str, float]]) -> Run:
    return Run(0, "", {"tokens": [tokens], "logprobs": [logprobs], "top2": [top2]}, [])


def test_generations_may_part_only_at_a_near_tie():
    baseline = _generation([5, 7, 9], [-0.1, -0.69, -0.2],
                           [{"5": -0.1, "1": -3.0}, {"7": -0.69, "8": -0.70}, {"9": -0.2}])
    tie = _generation([5, 8, 2], [-0.1, -0.69, -0.5], [])
    assert_same_generation(tie, baseline, 5e-2)  # 8 was 0.01 below 7: either order is right
    with pytest.raises(AssertionError, match="parts at step 0"):  # 1 was 2.9 below 5
        assert_same_generation(_generation([1, 7, 9], [-3.0, -0.69, -0.2], []), baseline, 5e-2)
    with pytest.raises(AssertionError):  # same tokens, a logprob off by more than tol
        assert_same_generation(_generation([5, 7, 9], [-0.3, -0.69, -0.2], []), baseline, 5e-2)


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
    assert worker["table"]["rows_for_sku"] == len(HIT_BUCKETS)  # all served: the counts agree
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


# --- fp8 -------------------------------------------------------------------------------------
# vLLM serves fp8 checkpoints with bfloat16 or float16 activations only (Fp8Config and its
# online methods refuse float32), so these runs are bfloat16: moetune's kernels and vLLM's
# differ by bfloat16 rounding inside the MoE, hence a looser logprob bound than float32's.
BF16_LOGPROB_TOL = 5e-2


def fp8_moetune_run(model: Path, workdir: Path, shape: Any, quantization: str | None = None,
                    table: Path | None = None) -> Run:
    """The model served with a table whose winners are moetune kernels (torch_loop up to 32
    tokens, torch_grouped above), neither of them the CPU rule's pick here for fp8."""
    if table is None:
        table = write_winners(workdir / "t.db", shape, HIT_BUCKETS[:5], "torch_loop")
        write_winners(table, shape, HIT_BUCKETS[5:], "torch_grouped")
    return run_engine(model, workdir / "run", dtype="bfloat16", quantization=quantization,
                      MOETUNE_TABLE=str(table))


def assert_fp8_layers_ran_moetune(run: Run, shape: Any) -> None:
    """Both layers described as fp8, served by moetune kernels on vLLM's scales: every call a
    hit, the plain copy kept, and the startup line naming the kernels each bucket runs."""
    worker = run.worker_stats
    assert worker["layers"] == 2
    (label,) = worker["counters"]
    assert shape.quant.value in label and "not handled" not in label, worker["counters"]
    counts = worker["counters"][label]
    assert counts["hit"] > 0 and counts["miss"] == counts["fallback"] == 0
    lines = [ln for ln in run.moetune_lines("INFO") if label in ln and "layers" in ln]
    assert lines and all("torch_loop" in ln and "torch_grouped" in ln for ln in lines), lines


def test_online_fp8_quantized_mixtral_runs_moetune_kernels(models, tmp_path, cpu_sku):
    """``LLM(quantization="fp8")``: vLLM quantizes the float32 checkpoint's experts to fp8 per
    tensor at load (its online ``fp8_per_tensor`` method) and serves them in bfloat16."""
    baseline = run_engine(models["mixtral"], tmp_path / "off", dtype="bfloat16",
                          quantization="fp8", MOETUNE_MODE="off")
    if baseline.rc != 0:
        errors = [ln for ln in baseline.log.splitlines() if "Error" in ln]
        pytest.skip(f"vLLM cannot serve online fp8 MoE on this CPU: {errors[-1:]}")
    shape = dataclasses.replace(model_shape(models["mixtral"], "bfloat16"),
                                quant=QuantScheme.FP8_PER_TENSOR)
    run = fp8_moetune_run(models["mixtral"], tmp_path, shape, quantization="fp8")
    assert_same_generation(run, baseline, BF16_LOGPROB_TOL)
    assert_fp8_layers_ran_moetune(run, shape)


@pytest.fixture(scope="module")
def fp8_block(tmp_path_factory) -> Path:
    return fp8_block_model(tmp_path_factory.mktemp("models") / "mixtral_fp8_block")


@pytest.fixture
def serves_block_fp8(fp8_block, cpu_sku) -> None:
    """vLLM serves block fp8 on the CPU with CPUExpertsFp8 (x86 AMX), which moetune keeps a
    plain copy of the weights for; elsewhere it has no kernel (or packs for W8A8), say why."""
    shape = model_shape(fp8_block, "bfloat16")
    ok, why = VllmCpuExpertsKernel.supports(shape.problem(1), cpu_sku)
    if not ok:
        pytest.skip(f"vLLM does not serve block-fp8 MoE with CPUExpertsFp8 here: {why}")


def test_block_fp8_checkpoint_runs_moetune_kernels_on_vllms_scales(fp8_block, tmp_path,
                                                                   serves_block_fp8):
    """A DeepSeek-V3-format checkpoint (fp8 e4m3 experts, ``weight_scale_inv`` per 128x128
    block): moetune reads the scheme from the layer's quant config and runs its kernels on a
    plain copy of the fp8 weights with vLLM's own block scales."""
    shape = model_shape(fp8_block, "bfloat16")
    assert shape.quant is QuantScheme.FP8_BLOCK_128X128
    baseline = run_engine(fp8_block, tmp_path / "off", dtype="bfloat16", MOETUNE_MODE="off")
    assert baseline.rc == 0, baseline.log[-3000:]
    run = fp8_moetune_run(fp8_block, tmp_path, shape)
    assert_same_generation(run, baseline, BF16_LOGPROB_TOL)
    assert_fp8_layers_ran_moetune(run, shape)
    experts = shape.num_experts * 3 * shape.intermediate_size * shape.hidden_size  # fp8 bytes
    assert run.worker_stats["plain_copy_bytes"] == 2 * experts


def test_block_fp8_table_tuned_here_is_served(fp8_block, tmp_path, cpu_sku, serves_block_fp8):
    """The real tuner on this CPU for the checkpoint's shape (``moetune tune --config``'s
    library call): whatever wins each bucket serves it, vLLM's own kernel or moetune's."""
    shape = model_shape(fp8_block, "bfloat16")
    table = tmp_path / "tuned.db"
    outcomes = run_job([shape.problem(m) for m in (1, 4, 32)], table, cpu_sku,
                       JobOptions(device="cpu", trials=6, reps=5))
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    baseline = run_engine(fp8_block, tmp_path / "off", dtype="bfloat16", MOETUNE_MODE="off")
    run = run_engine(fp8_block, tmp_path / "run", dtype="bfloat16", MOETUNE_TABLE=str(table))
    assert_same_generation(run, baseline, BF16_LOGPROB_TOL)
    (counts,) = run.worker_stats["counters"].values()
    assert counts["hit"] > 0 and counts["miss"] == counts["fallback"] == 0
