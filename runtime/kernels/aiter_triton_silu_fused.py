"""GEMM1 with SiLU-and-mul fused into its epilogue (aiter's ``moe_op_silu_fused``), then
``moe_op.fused_moe`` for GEMM2: one pass less over the (M * topk, 2I) intermediate.

The kernel interleaves gate and up columns inside each N tile and writes BLOCK_SIZE_N / 2
activated columns into a 2-D (M * topk, I) output, indexed by the flat (token * topk + slot) id
(``stride_cm`` is the output's first stride). A 3-D (M, topk, I) output makes those rows stride
``topk`` times too far: the illegal memory access once seen on an H200.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moetune.runtime import aiter_loader
from moetune.runtime.kernels.aiter_triton import Stage, bind_gemm
from moetune.runtime.kernels.aiter_triton_split import AiterTritonSplitKernel
from moetune.runtime.kernels.base import MoEWeights
from moetune.runtime.platform import SKU
from moetune.runtime.problem import Activation, MoEProblem

if TYPE_CHECKING:  # _align imports triton, which CPU-only installs lack
    from moetune.runtime.kernels._align import Routing


class AiterTritonSiluFusedKernel(AiterTritonSplitKernel):
    """Gated SiLU only; each GEMM has its own config (the fused GEMM1 is a different kernel)."""

    name = "aiter_triton_silu_fused"
    modules = ("moe_op", "silu_fused")

    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        if problem.activation is not Activation.SILU or not problem.gated:
            return "fuses gated SiLU only"
        return None

    @classmethod
    def first_stage(cls, problem: MoEProblem, weights: MoEWeights, config: dict[str, int]) -> Stage:
        silu_fused = aiter_loader.load("silu_fused").module
        gemm1 = bind_gemm(silu_fused.fused_moe_silu, problem, weights.w13, weights.w13_scale, config,
                          persistent=cls.persistent)
        inter = weights.w2.shape[2]
        on_input = problem.router_weight_on_input

        def stage(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  routing: Routing) -> torch.Tensor:
            h = x.new_empty(topk_ids.numel(), inter)
            gemm1(x, h, topk_weights, topk_ids, routing, on_input, topk_ids.shape[1])
            return h

        return stage
