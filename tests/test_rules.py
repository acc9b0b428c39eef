"""One test per platform rule (and per branch of it): what serving runs when the table has nothing."""

import dataclasses
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
    (dict(quant="fp8_per_tensor", dtype="bfloat16"), "fp8_per_tensor not supported"),
])
def test_cpu_rule_falls_back_to_the_torch_loop_where_vllm_cannot_run_it(changes, why, cpu_sku):
    choice = rule_choice(dataclasses.replace(SMALL, **changes), cpu_sku)
    assert choice.kernel == "torch_loop"
    assert why in choice.reason


def test_cpu_rule_without_vllm_is_the_torch_loop_and_says_why(cpu_sku, monkeypatch):
    monkeypatch.setattr(vllm_cpu_experts, "_vllm", lambda: (None, "vLLM is not installed"))
    choice = rule_choice(SMALL, cpu_sku)
    assert choice.kernel == "torch_loop" and "vLLM is not installed" in choice.reason


def test_vllm_cpu_kernel_is_not_eligible_off_the_cpu():
    ok, why = vllm_cpu_experts.VllmCpuExpertsKernel.supports(SMALL, ROCM)
    assert not ok and "CPU only" in why


@pytest.mark.parametrize("changes,kernel", [
    (dict(quant="fp8_block_128x128"), "aiter_asm_blockscale"),
    (dict(quant="fp8_per_channel", router_weight_on_input=True, topk=1), "aiter_asm_tkw1"),
    (dict(quant="fp8_per_channel", router_weight_on_input=True, topk=2), "aiter_fused_moe"),
    (dict(quant="fp8_per_channel", topk=1), "aiter_fused_moe"),
    (dict(), "aiter_fused_moe"),
])
def test_rocm_rule_is_the_seed_rule(changes, kernel):
    assert rule_choice(dataclasses.replace(BASE, **changes), ROCM).kernel == kernel
