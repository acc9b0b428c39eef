"""Grouped GEMM through ``torch._grouped_mm``: permute tokens by expert, two grouped GEMMs, unpermute."""

from __future__ import annotations

from typing import Any, Callable

import torch

from moetune.runtime.kernels._math import activate
from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights, write
from moetune.runtime.kernels.quant import dequantize_fp8
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import DType, MoEProblem, QuantScheme


class TorchGroupedKernel(BaseKernel):
    """Two launches for all experts; the fastest torch path once experts see many tokens.

    fp8 weights stay fp8 in the layer: each call dequantizes them to the activation dtype
    first (a transient copy, W8A16), a cost the tuner weighs against the loop's per-expert one.
    """

    name = "torch_grouped"
    deterministic = True  # a sum over top-k in slot order
    graph_safe = False  # torch.bincount on CUDA reads the largest id back to size its output
    vendors = frozenset({Vendor.CPU, Vendor.NVIDIA})  # _grouped_mm is not built for ROCm here
    min_sm = 90
    quants = frozenset(QuantScheme)  # fp8 on the CPU only, below

    @classmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        return grouped_mm_missing() or super()._supports_device(problem, sku)

    @classmethod
    def _supports_quant(cls, problem: MoEProblem, sku: SKU) -> str | None:
        if problem.quant.is_fp8 and sku.vendor is not Vendor.CPU:
            return "fp8 runs dequantized per call on the CPU only (on GPUs: torch_scaled_grouped)"
        return super()._supports_quant(problem, sku)

    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        reason = grouped_mm_dtype_reason(problem, sku)
        if reason:
            return reason
        # cuBLAS grouped GEMM needs 16-byte aligned strides: 8 bf16 elements.
        if sku.vendor is Vendor.NVIDIA and (problem.hidden_size % 8 or problem.intermediate_size % 8):
            return "hidden and intermediate sizes must be multiples of 8 on CUDA"
        return super()._supports_problem(problem, sku)

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        grouped = _grouped_weights(weights)
        num_experts = weights.w13.shape[0]
        on_input = problem.router_weight_on_input

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
            topk = topk_ids.shape[1]
            flat_ids = topk_ids.reshape(-1)
            order = torch.argsort(flat_ids, stable=True)
            offsets = torch.cumsum(torch.bincount(flat_ids, minlength=num_experts), 0)
            offsets = offsets.to(torch.int32)
            weight = topk_weights.reshape(-1)[order].unsqueeze(1)
            inp = x[order // topk]
            w13_t, w2_t = grouped(x.dtype)
            if on_input:
                inp = (inp * weight).to(x.dtype)
            h = activate(torch._grouped_mm(inp, w13_t, offs=offsets), problem)
            y = torch._grouped_mm(h.to(x.dtype), w2_t, offs=offsets).float()
            if not on_input:
                y = y * weight
            unpermuted = torch.empty_like(y)
            unpermuted[order] = y
            return write(unpermuted.view(-1, topk, x.shape[1]).sum(dim=1), out, x.dtype)

        return run


def grouped_mm_missing() -> str | None:
    """Why this torch cannot run ``torch._grouped_mm`` (what both grouped-GEMM kernels call),
    or None."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm"
    return None


def grouped_mm_dtype_reason(problem: MoEProblem, sku: SKU) -> str | None:
    """Why ``torch._grouped_mm`` cannot take ``problem``'s dtype on ``sku``, or None."""
    if sku.vendor is Vendor.NVIDIA and problem.dtype is not DType.BFLOAT16:
        return "_grouped_mm on CUDA takes bfloat16 only"
    return None


def _grouped_weights(
        weights: MoEWeights) -> Callable[[torch.dtype], tuple[torch.Tensor, torch.Tensor]]:
    """(E, H, 2I) and (E, I, H) views, as grouped_mm computes ``x @ w`` per group; fp8
    weights are dequantized to the requested dtype on each call."""
    w13, w2 = weights.w13, weights.w2
    if weights.quant is QuantScheme.NONE:
        return lambda dtype: (w13.transpose(1, 2), w2.transpose(1, 2))
    s13, s2, scheme = weights.w13_scale, weights.w2_scale, weights.quant
    if s13 is None or s2 is None:
        raise ValueError(f"{scheme.value} weights need w13_scale and w2_scale")
    return lambda dtype: (dequantize_fp8(w13, s13, scheme, dtype).transpose(1, 2),
                          dequantize_fp8(w2, s2, scheme, dtype).transpose(1, 2))
