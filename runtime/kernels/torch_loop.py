"""Per-expert loop in the layer's dtype: gather each expert's tokens, two GEMMs, scatter-add."""

from __future__ import annotations

from typing import Any

import torch

from moetune.runtime.kernels._math import activate
from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights
from moetune.runtime.platform import SKU
from moetune.runtime.problem import MoEProblem


class TorchLoopKernel(BaseKernel):
    """The simplest correct kernel; few launches per expert, so it wins where experts are few."""

    name = "torch_loop"

    @classmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        return None

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        w13, w2 = weights.w13, weights.w2
        on_input = problem.router_weight_on_input

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            flat_ids = topk_ids.reshape(-1)
            order = torch.argsort(flat_ids, stable=True)
            counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
            tokens = order // topk_ids.shape[1]
            weight = topk_weights.reshape(-1)[order].unsqueeze(1)
            start = 0
            for e, n in enumerate(counts):
                if n == 0:
                    continue
                tok, w = tokens[start:start + n], weight[start:start + n]
                start += n
                inp = x[tok]
                if on_input:
                    inp = (inp * w).to(x.dtype)
                y = activate(inp @ w13[e].T, problem) @ w2[e].T
                out.index_add_(0, tok, y.float() if on_input else y.float() * w)
            return out.to(x.dtype)

        return run
