"""GEMM1 with GELU fused into its epilogue (aiter's ``moe_op_gelu``), then ``moe_op.fused_moe``.

What aiter's kernel computes decides what is eligible: GELU of the whole output (ungated layers),
tanh-approximated (within 1e-3 of exact GELU); it skips the GELU when it multiplies the router
weight, so router-weight-on-input layers cannot use it; per-tensor fp8 quantizes activations to
ROCm's e4m3fnuz; and it swaps the block shape's (n, k), so only square scale blocks are right.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moetune.runtime import aiter_loader
from moetune.runtime.kernels.aiter_triton import Stage, bind_gemm
from moetune.runtime.kernels.aiter_triton_split import AiterTritonSplitKernel
from moetune.runtime.kernels.base import MoEWeights
from moetune.runtime.platform import SKU
from moetune.runtime.problem import Activation, DType, MoEProblem, QuantScheme

if TYPE_CHECKING:  # _align imports triton, which CPU-only installs lack
    from moetune.runtime.kernels._align import Routing


class AiterTritonGeluFusedKernel(AiterTritonSplitKernel):
    """Ungated GELU, unquantized or block-fp8; each GEMM has its own config."""

    name = "aiter_triton_gelu_fused"
    modules = ("moe_op", "gelu")
    quants = frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK_128X128})

    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        if problem.activation is not Activation.GELU or problem.gated:
            return "fuses ungated GELU only"
        if problem.router_weight_on_input:
            return "aiter's GELU kernel skips the GELU when it applies the router weight"
        if problem.dtype is DType.FLOAT32:
            return ("float16 and bfloat16 only: its tanh-approximated GELU is ~2e-4 from exact "
                    "GELU, beyond the float32 gate's 1e-4")
        return None

    @classmethod
    def first_stage(cls, problem: MoEProblem, weights: MoEWeights, config: dict[str, int]) -> Stage:
        gelu = aiter_loader.load("gelu").module
        gemm1 = bind_gemm(gelu.fused_moe_gelu, problem, weights.w13, weights.w13_scale, config,
                          persistent=cls.persistent)
        inter = weights.w2.shape[2]

        def stage(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  routing: Routing) -> torch.Tensor:
            m, topk = topk_ids.shape
            h = x.new_empty(m, topk, inter)
            gemm1(x, h, topk_weights, topk_ids, routing, False, topk)
            return h.view(m * topk, inter)

        return stage
