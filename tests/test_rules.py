"""One test per platform rule (and per branch of it): what serving runs when the table has nothing."""

import dataclasses
import json
import importlib.util

import pytest

from moetune.runtime.kernels import vllm_cpu_experts
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import rule_choice
from moetune.tuner.measure import Measurer, Status

ROCM = SKU(Vendor.AMD, "MI300X", "gfx942", 304, 192 << 30)
BASE = MoEProblem(16, 7168, 256, 256, 8)
SMALL = MoEProblem(24, 128, 64, 8, 2, dtype="float32")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (bash scripts/setup.sh --vllm)")


@needs_vllm
@pytest.mark.parametrize("problem", [
    BASE,
    SMALL,
    dataclasses.replace(SMALL, intermediate_size=50),  # padded to the kernel's alignment
    dataclasses.replace(SMALL, topk=1, router_weight_on_input=True),
    dataclasses.replace(SMALL, dtype="float16", activation="gelu"),
], ids=lambda p: p.describe())
def test_cpu_rule_is_vllms_own_kernel_when_vllm_runs_the_layer(problem, cpu_sku):
    """The CPU rule is what vLLM runs, and that kernel passes the tuner's correctness gate."""
    choice = rule_choice(problem, cpu_sku)
    assert (choice.kernel, choice.params) == ("vllm_cpu_experts", {})
    assert "vLLM's CPU fused-MoE kernel" in choice.reason
    if problem is BASE:
        return  # too big to gate in a unit test
    result = Measurer(problem, "cpu", default_registry, reps=2).measure("vllm_cpu_experts", {})
    assert result.status is Status.OK, result.reason


@needs_vllm
@pytest.mark.parametrize("changes,why", [
    (dict(gated=False), "gated (act-and-mul) layers only"),
    (dict(router_weight_on_input=True), "top-1 routing only"),
    (dict(hidden_size=100), "hidden divisible by 32"),
    (dict(quant="fp8_per_tensor", dtype="bfloat16"),
     "fp8_per_tensor not supported (none, fp8_block_128x128 only)"),
])
def test_cpu_rule_falls_back_to_the_torch_loop_where_vllm_cannot_run_it(changes, why, cpu_sku):
    choice = rule_choice(dataclasses.replace(SMALL, **changes), cpu_sku)
    assert choice.kernel == "torch_loop"
    assert why in choice.reason


def test_cpu_rule_without_vllm_is_the_torch_loop_and_says_why(cpu_sku, monkeypatch):
    monkeypatch.setattr(vllm_cpu_experts, "vllm_cpu", lambda: (None, "vLLM is not installed"))
    choice = rule_choice(SMALL, cpu_sku)
    assert choice.kernel == "torch_loop" and "vLLM is not installed" in choice.reason


def test_vllm_cpu_kernel_is_not_eligible_off_the_cpu():
    ok, why = vllm_cpu_experts.VllmCpuExpertsKernel.supports(SMALL, ROCM)
    assert not ok and "needs the CPU" in why


@pytest.mark.parametrize("changes,kernel", [
    (dict(quant="fp8_block_128x128"), "aiter_asm_blockscale"),
    (dict(quant="fp8_per_channel", router_weight_on_input=True, topk=1), "aiter_asm_tkw1"),
    (dict(quant="fp8_per_channel", router_weight_on_input=True, topk=2), "aiter_fused_moe"),
    (dict(quant="fp8_per_channel", topk=1), "aiter_fused_moe"),
    (dict(), "aiter_fused_moe"),
])
def test_rocm_rule_is_the_seed_rule(changes, kernel):
    assert rule_choice(dataclasses.replace(BASE, **changes), ROCM).kernel == kernel


H200 = SKU(Vendor.NVIDIA, "H200", "sm_90", 132, 141 << 30)
MIXTRAL = MoEProblem(1, 4096, 14336, 8, 2)
DEEPSEEK_TP8 = MoEProblem(1, 7168, 256, 256, 8, quant="fp8_block_128x128")


def _vllm_pick(problem: MoEProblem, monkeypatch) -> dict:
    """The config vLLM's own ``try_get_optimal_moe_config`` picks for ``problem`` on an H200."""
    from vllm.model_executor.layers.fused_moe import fused_moe as vllm_fused_moe

    from moetune.runtime.vllm.configs import selectors

    monkeypatch.setattr(vllm_fused_moe, "get_device_name_as_file_name", lambda: "NVIDIA_H200")
    vllm_fused_moe.get_moe_configs.cache_clear()
    e, h, i = problem.num_experts, problem.hidden_size, problem.intermediate_size
    dtype, block = selectors(problem)
    config = vllm_fused_moe.try_get_optimal_moe_config(
        (e, 2 * i, h), (e, h, i), problem.topk, dtype, problem.num_tokens,
        list(block) if block else None)
    vllm_fused_moe.get_moe_configs.cache_clear()
    return {k: v for k, v in config.items() if not (k == "SPLIT_K" and v == 1)}


@needs_vllm
@pytest.mark.parametrize("problem", [
    *(MIXTRAL.with_tokens(m) for m in (1, 3, 100, 1024, 5000)),  # 3: a tie, vLLM takes 2
    *(DEEPSEEK_TP8.with_tokens(m) for m in (1, 64, 300)),
    MoEProblem(300, 4096, 14336, 8, 2, quant="fp8_per_tensor"),  # fp8_w8a8 file
    MoEProblem(100, 1024, 96, 8, 2),  # no file: vLLM's default heuristic
], ids=lambda p: p.describe())
def test_cuda_rule_runs_the_config_vllm_picks(problem, monkeypatch):
    """The CUDA rule (every winner's baseline) is vLLM's ``try_get_optimal_moe_config``: its
    shipped tuned file where it has one for the shape and GPU, else its default heuristic."""
    choice = rule_choice(problem, H200)
    if choice.kernel != "aiter_triton":
        pytest.skip(f"aiter's Triton modules do not load here: {choice.reason}")
    assert choice.params == _vllm_pick(problem, monkeypatch), choice.reason
    assert ("tuned config" in choice.reason) == (problem.intermediate_size != 96)


@needs_vllm
def test_cuda_rule_reads_the_users_vllm_folder_first(tmp_path, monkeypatch):
    problem = MIXTRAL.with_tokens(50)
    entry = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
             "num_warps": 4, "num_stages": 6}
    (tmp_path / "E=8,N=14336,device_name=NVIDIA_H200.json").write_text(
        json.dumps({"triton_version": "3.6.0", "16": {**entry, "BLOCK_SIZE_M": 16}, "64": entry}))
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    choice = rule_choice(problem, H200)
    if choice.kernel != "aiter_triton":
        pytest.skip(f"aiter's Triton modules do not load here: {choice.reason}")
    assert choice.params == entry == _vllm_pick(problem, monkeypatch)  # 8 and 6: beyond the grid
    assert "entry M=64" in choice.reason


def test_cuda_rule_uses_the_default_config_for_a_file_entry_it_cannot_run(tmp_path, monkeypatch):
    from moetune.runtime.vllm.configs import vllm_default_config

    (tmp_path / "E=8,N=14336,device_name=NVIDIA_H200.json").write_text(json.dumps(
        {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
               "num_warps": 4, "num_stages": 3, "num_ctas": 2}}))
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    choice = rule_choice(MIXTRAL, H200)
    if choice.kernel != "aiter_triton":
        pytest.skip(f"aiter's Triton modules do not load here: {choice.reason}")
    assert choice.params == vllm_default_config(MIXTRAL)
    assert "cannot run here" in choice.reason and "num_ctas" in choice.reason


@needs_vllm
def test_triton_families_start_their_search_from_the_rules_config():
    """The rule is the bar to beat, so every aiter Triton family's first trial is its config."""
    from moetune.runtime.kernels.triton_config import with_prefix

    problem = MIXTRAL.with_tokens(256)
    rule = rule_choice(problem, H200)
    if rule.kernel != "aiter_triton":
        pytest.skip(f"aiter's Triton modules do not load here: {rule.reason}")
    assert "tuned config" in rule.reason
    split = with_prefix(rule.params, "g1_") | with_prefix(rule.params, "g2_")
    for name in ("aiter_triton", "aiter_triton_silu_fused", "aiter_triton_persistent"):
        seed = default_registry.get(name).seed_params(problem, H200)
        assert seed == (rule.params if name == "aiter_triton" else split)
