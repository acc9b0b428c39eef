"""The correctness oracle: the MoE layer in float32, one expert at a time."""

from __future__ import annotations

from typing import Any

import torch

from moetune.runtime.kernels._math import activate
from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights, write
from moetune.runtime.kernels.quant import dequantize
from moetune.runtime.problem import MoEProblem, QuantScheme


class ReferenceKernel(BaseKernel):
    """Float32 math on dequantized weights; never a tuning candidate, always the yardstick."""

    name = "reference"
    deterministic = True  # float32, one index_add_ per expert in expert order
    candidate = False
    quants = frozenset(QuantScheme)

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        w13, w2 = dequantize(weights)

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
            xf = x.float()
            acc = torch.zeros_like(xf)
            for e in topk_ids.unique().tolist():
                tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
                weight = topk_weights[tok, slot].float().unsqueeze(1)
                inp = xf[tok] * weight if problem.router_weight_on_input else xf[tok]
                y = activate(inp @ w13[e].T, problem) @ w2[e].T
                acc.index_add_(0, tok, y if problem.router_weight_on_input else y * weight)
            return write(acc, out, x.dtype)

        return run
