"""vLLM's own CPU fused-MoE kernels, run as vLLM runs them.

This is what vLLM serves MoE with on the CPU, so it is the CPU rule's pick: every CPU winner is
timed against it. Unquantized (``torch.ops._C.cpu_fused_moe``): ``prepare`` does what vLLM's
``CPUUnquantizedExperts`` does at load (``process_weights_after_loading``): zero-pad the
intermediate size to the kernel's alignment and prepack both weights for the ISA vLLM picks on
this machine (its experts classes, tried in vLLM's order: x86 AMX, Arm NEON, Power VSX, then the
portable ``vec`` path). Block-fp8 (``fused_experts_cpu``, W8A16): what vLLM's fp8 oracle does for
its ``CPU`` backend, ``CPUExpertsFp8``: VNNI-prepack the fp8 weights at load
(``prepare_fp8_moe_layer_for_cpu``) and call the op with the 128x128 block scales as they are.
vLLM has no CPU kernel for per-tensor or per-channel fp8 MoE. vLLM is optional: its pieces are
imported lazily (``runtime/vllm/cpu.py``), only when a CPU problem asks.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.vllm.cpu import experts_class, fp8_experts_class, vllm_cpu

#: ``CPUExpertsFp8`` runs only where AMX tiles exist (its ``_supports_current_device``).
_FP8_ISA = "amx"


class VllmCpuExpertsKernel(BaseKernel):
    """vLLM's C++ CPU MoE (unquantized or block-fp8) on weights prepacked as vLLM does."""

    name = "vllm_cpu_experts"
    deterministic = True  # vLLM's own CPU kernel: served as vLLM serves it
    vendors = frozenset({Vendor.CPU})
    #: vLLM has no CPU MoE kernel for per-tensor or per-channel fp8 (CPUExpertsFp8 runs blocks).
    quants = frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK_128X128})

    @classmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        return super()._supports_device(problem, sku) or vllm_cpu()[1]

    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        return super()._supports_problem(problem, sku) or _experts_for(problem)[1]

    @classmethod
    def isa(cls, problem: MoEProblem) -> str | None:
        """The ISA vLLM's kernel runs ``problem`` with here (``vec``, ``amx``, ...), or None."""
        experts = _experts_for(problem)[0]
        if experts is None:
            return None
        return _FP8_ISA if problem.quant.is_fp8 else experts.isa

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        experts, why = _experts_for(problem)
        if experts is None:
            raise RuntimeError(f"{cls.name} cannot run {problem.describe()}: {why}")
        if cls.isa(problem) == "amx":
            _request_amx()
        if problem.quant.is_fp8:
            return _prepare_fp8(weights)
        ops = vllm_cpu()[0].ops
        isa = experts.isa
        inter = problem.intermediate_size
        padded = _round_up(inter, math.lcm(experts.output_alignment,
                                           experts.reduction_alignment))
        w13, w2 = weights.w13, weights.w2
        if padded != inter:  # as CPUUnquantizedExperts._pad_moe_intermediate
            num_experts, _, hidden = w13.shape
            w13_p = w13.new_zeros(num_experts, 2 * padded, hidden)
            w13_p[:, :inter] = w13[:, :inter]
            w13_p[:, padded:padded + inter] = w13[:, inter:]
            w2_p = w2.new_zeros(num_experts, hidden, padded)
            w2_p[:, :, :inter] = w2
            w13, w2 = w13_p, w2_p
        w13 = ops.cpu_prepack_moe_weight(w13.contiguous(), isa)
        w2 = ops.cpu_prepack_moe_weight(w2.contiguous(), isa)
        fused_moe = torch.ops._C.cpu_fused_moe
        act = problem.activation.value
        on_input = problem.router_weight_on_input

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
            if on_input:  # what vLLM's prepare step does (top-1 only) before the experts run
                x = x * topk_weights.to(x.dtype)
            if topk_ids.dtype != torch.int32:
                topk_ids = topk_ids.to(torch.int32)
            if out is None:
                out = torch.empty_like(x)
            fused_moe(out, x, w13, w2, None, None, topk_weights, topk_ids, on_input, act, isa)
            return out

        return run


def _request_amx() -> None:
    """Ask Linux for AMX tile state (arch_prctl) before vLLM's ops use it. A process may run AMX
    instructions only once it has asked: torch's oneDNN asks on its first AMX matmul, vLLM's MoE
    ops do not, so where they are a process's first AMX code (a tune, a benchmark) it dies of
    SIGILL. Inside vLLM's engine the model's matmuls have asked already."""
    if not torch._C._cpu._init_amx():
        raise RuntimeError("vLLM's CPU MoE runs AMX tiles here, and Linux refused this process "
                           "their use (arch_prctl ARCH_REQ_XCOMP_PERM)")


def _prepare_fp8(weights: MoEWeights) -> MoEFn:
    """``CPUExpertsFp8``: weights VNNI-packed at load, the op called as its ``apply`` does."""
    vllm = vllm_cpu()[0]
    assert weights.w13_scale is not None and weights.w2_scale is not None
    # The packing op's schema marks its input as written (``Tensor!``): pack copies, so the
    # caller's weights (shared by every candidate in the tuner) stay as they are.
    w13, w2 = vllm.cpu_moe.prepare_fp8_moe_layer_for_cpu(weights.w13.clone(), weights.w2.clone())
    s13, s2 = weights.w13_scale.float().contiguous(), weights.w2_scale.float().contiguous()
    fused_experts = vllm.ops.fused_experts_cpu
    method = vllm.ops.CPUQuantMethod.FP8_W8A16

    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        if topk_ids.dtype != torch.int32:
            topk_ids = topk_ids.to(torch.int32)
        if out is None:
            out = torch.empty_like(x)
        fused_experts(out, x, w13, w2, topk_weights, topk_ids, method, s13, s2, None, None,
                      [128, 128], None, None, None, None, True)
        return out

    return run


def _experts_for(problem: MoEProblem) -> tuple[Any, str | None]:
    if problem.quant.is_fp8:
        return fp8_experts_class(problem.dtype, problem.activation.value, problem.gated,
                                 problem.router_weight_on_input)
    return experts_class(problem.dtype, problem.activation.value, problem.gated,
                          problem.hidden_size, problem.router_weight_on_input, problem.topk)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
