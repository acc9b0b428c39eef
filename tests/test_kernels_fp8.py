"""fp8 MoE on the CPU: moetune's torch kernels on fp8 weights, vLLM's CPU fp8 kernel as the rule
where vLLM runs one, and a correctness gate that catches a kernel applying a scale to the wrong
group (transposed block scales, a shift by one block, row or expert)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from moetune.runtime.kernels.base import MoEFn, MoEWeights
from moetune.runtime.kernels.quant import FP8
from moetune.runtime.kernels.torch_loop import TorchLoopKernel
from moetune.runtime.kernels.vllm_cpu_experts import VllmCpuExpertsKernel
from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.registry import Registry, default_registry
from moetune.runtime.rules import cpu_rule
from moetune.tuner.confirm import confirm
from moetune.tuner.gate import relative_error, tolerance
from moetune.tuner.inputs import Routing, make_batch, make_weights
from moetune.tuner.measure import Measurer, Status
from moetune.tuner.search import search

SCHEMES = [QuantScheme.FP8_PER_TENSOR, QuantScheme.FP8_PER_CHANNEL, QuantScheme.FP8_BLOCK_128X128]
# H and I span two 128-blocks each, so block scales can be transposed or shifted by a block.
PROBLEMS = [MoEProblem(37, 256, 256, 8, 2, dtype=dtype, quant=scheme)
            for scheme in SCHEMES for dtype in ("float32", "bfloat16")]


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.describe())
@pytest.mark.parametrize("name", ["torch_loop", "torch_grouped", "vllm_cpu_experts"])
def test_fp8_kernel_matches_reference(name, problem, cpu_sku):
    kernel = default_registry.get(name)
    ok, why = kernel.supports(problem, cpu_sku)
    if name == "vllm_cpu_experts" and not ok:
        pytest.skip(why)  # vLLM runs no fp8 kernel for this problem on this CPU (says why)
    assert ok, why
    weights = make_weights(problem, "cpu", seed=1)
    batch = make_batch(problem, "cpu", seed=2, routing=Routing.ZIPF)
    ref = default_registry.get("reference").prepare(problem, {}, weights)(*batch.args())
    w13 = weights.w13.clone()
    out = kernel.prepare(problem, {}, weights)(*batch.args())
    assert out.dtype == batch.x.dtype and out.shape == batch.x.shape
    assert relative_error(out, ref) <= tolerance(problem)
    assert weights.w13.dtype == FP8 and torch.equal(weights.w13.view(torch.uint8),
                                                    w13.view(torch.uint8))


def test_cpu_rule_for_fp8_is_vllms_kernel_where_vllm_runs_one(cpu_sku):
    pytest.importorskip("vllm", reason="the CPU rule is vLLM's kernel only where vLLM is installed")
    block = MoEProblem(4, 256, 256, 8, 2, quant="fp8_block_128x128")
    ok, why = VllmCpuExpertsKernel.supports(block, cpu_sku)
    rule = cpu_rule(block, cpu_sku)
    if ok:  # an x86 CPU with AMX: vLLM serves block fp8 with CPUExpertsFp8
        assert rule.kernel == "vllm_cpu_experts" and "isa amx" in rule.reason
    else:
        assert rule.kernel == "torch_loop" and why in rule.reason
        if not torch.cpu._is_amx_tile_supported():
            assert "AMX" in why
    for scheme in ("fp8_per_tensor", "fp8_per_channel"):  # vLLM has no CPU kernel for these
        problem = dataclasses.replace(block, quant=scheme)
        ok, why = VllmCpuExpertsKernel.supports(problem, cpu_sku)
        assert not ok and scheme in why
        assert cpu_rule(problem, cpu_sku).kernel == "torch_loop"


def _shift(scale: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.roll(scale, 1, dims=dim)


#: How a buggy kernel can misread scales, per scheme: (name, w13 scale -> wrong w13 scale).
MISREADS = {
    QuantScheme.FP8_PER_TENSOR: [("another expert's", lambda s: _shift(s, 0))],
    QuantScheme.FP8_PER_CHANNEL: [("off by one row", lambda s: _shift(s, 1))],
    QuantScheme.FP8_BLOCK_128X128: [("transposed", lambda s: s.transpose(1, 2).contiguous()),
                                    ("off by one block", lambda s: _shift(s, 2))],
}


def misreading_kernel(label: str, misread: Any) -> type[TorchLoopKernel]:
    """torch_loop, except that it applies ``misread`` to GEMM1's weight scales."""

    class Misread(TorchLoopKernel):
        name = "misread_" + label.replace(" ", "_").replace("'", "")

        @classmethod
        def prepare(cls, problem: MoEProblem, params: dict[str, Any],
                    weights: MoEWeights) -> MoEFn:
            assert weights.w13_scale is not None
            bad = dataclasses.replace(weights, w13_scale=misread(weights.w13_scale))
            return super().prepare(problem, params, bad)

    return Misread


@pytest.mark.parametrize("scheme,label,misread",
                         [(s, label, f) for s, cases in MISREADS.items() for label, f in cases],
                         ids=lambda v: v.value if isinstance(v, QuantScheme) else None)
def test_gate_catches_a_kernel_that_misreads_scales(scheme, label, misread, cpu_sku):
    """The tuner's weights give every quantization group its own scale: a misread scale is far
    off (with plain random weights, transposed block scales were within the fp8 tolerance)."""
    problem = MoEProblem(16, 256, 128, 8, 2, dtype="float32", quant=scheme)  # w13: 2x2 blocks
    kernel = misreading_kernel(label, misread)
    registry = Registry({n: p for n, p in default_registry.paths().items()
                         if n in ("reference", "torch_loop", "torch_grouped", "vllm_cpu_experts")})
    registry.add(kernel)
    measurer = Measurer(problem, "cpu", registry, reps=3)
    assert misread(measurer.weights.w13_scale).shape == measurer.weights.w13_scale.shape
    verdict = measurer.measure(kernel.name, {})
    assert verdict.status is Status.WRONG, (label, verdict)
    assert verdict.error > 3 * tolerance(problem)
    results = search(problem, cpu_sku, measurer, registry.candidates(problem, cpu_sku), trials=6)
    assert results[(kernel.name, "{}")].status is Status.WRONG
    assert {"torch_loop", "torch_grouped"} <= {k for (k, _), r in results.items()
                                               if r.status is Status.OK}
    decision = confirm(problem, cpu_sku, measurer, results, rounds=2, reps=3)
    assert decision.winner.kernel != kernel.name
