"""fp8 grouped GEMMs through ``torch._scaled_grouped_mm`` (CUTLASS, row-wise scales): permute
tokens by expert, two scaled grouped GEMMs, unpermute and sum over top-k.

Activations are quantized per token (one Triton launch) for both weight schemes; per-tensor
weight scales are broadcast to rows. The router weight scales whole rows, so it is folded into
the row scale of GEMM1 (weight on input) or GEMM2 instead of costing a pass of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from moetune.runtime.kernels._math import activate
from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import DType, MoEProblem, QuantScheme


class TorchScaledGroupedKernel(BaseKernel):
    """Two CUTLASS launches for all experts; fp8 per-tensor and per-channel weights."""

    name = "torch_scaled_grouped"
    deterministic = True  # a sum over top-k in slot order
    vendors = frozenset({Vendor.NVIDIA})
    min_sm = 90
    requires = ("triton",)  # activation quantization
    quants = frozenset({QuantScheme.FP8_PER_TENSOR, QuantScheme.FP8_PER_CHANNEL})  # row-wise scales
    dtypes = frozenset({DType.BFLOAT16})  # what _scaled_grouped_mm writes
    # CUTLASS needs 16-byte aligned rows: 16 fp8 elements.
    hidden_align = intermediate_align = 16

    @classmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        if not hasattr(torch, "_scaled_grouped_mm"):
            return f"torch {torch.__version__} has no _scaled_grouped_mm"
        return super()._supports_device(problem, sku)

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        from moetune.runtime.kernels._act_quant import quantize_rows

        assert weights.w13_scale is not None and weights.w2_scale is not None
        w13_t = weights.w13.transpose(1, 2)  # (E, H, 2I), column-major as CUTLASS wants
        w2_t = weights.w2.transpose(1, 2)  # (E, I, H)
        s13, s2 = _row_scales(weights.w13_scale, w13_t), _row_scales(weights.w2_scale, w2_t)
        num_experts = w13_t.shape[0]
        # searchsorted against 1..E gives each expert's end offset without a host sync.
        ends = torch.arange(1, num_experts + 1, device=w13_t.device)
        on_input = problem.router_weight_on_input

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
            m, topk = topk_ids.shape
            sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
            offsets = torch.searchsorted(sorted_ids, ends.to(sorted_ids.dtype), out_int32=True)
            weight = topk_weights.reshape(-1)[order]
            q, scale = quantize_rows(x)
            rows = order // topk
            scale = scale[rows, 0]
            h = torch._scaled_grouped_mm(q[rows], w13_t, scale * weight if on_input else scale,
                                         s13, offs=offsets, out_dtype=torch.bfloat16)
            q, scale = quantize_rows(activate(h, problem))
            scale = scale[:, 0] if on_input else scale[:, 0] * weight
            y = torch._scaled_grouped_mm(q, w2_t, scale, s2, offs=offsets, out_dtype=torch.bfloat16)
            unpermuted = torch.empty_like(y)
            unpermuted[order] = y
            return torch.sum(unpermuted.view(m, topk, -1), dim=1, out=out)

        return run


def _row_scales(scale: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """(E, N) float32 scales of the weight's output columns; per-tensor scales broadcast."""
    if scale.dim() == 1:
        scale = scale[:, None].expand(-1, w_t.shape[2])
    return scale.float().contiguous()
