"""Dense evaluation: every expert on every token of a chunk, then keep the routed ones."""

from __future__ import annotations

from typing import Any

import torch

from moetune.runtime.kernels._math import activate
from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights, Param
from moetune.runtime.platform import SKU
from moetune.runtime.problem import MoEProblem


class TorchDenseKernel(BaseKernel):
    """No gather, no sort: wasteful in FLOPs (E/topk times) but only two batched GEMMs, which
    wins at tiny token counts and few experts. ``chunk_tokens`` bounds its E*M*I memory."""

    name = "torch_dense"
    deterministic = True  # a token's weights scattered to distinct experts, then dense GEMMs
    params = (Param("chunk_tokens", (8, 32, 128, 512)),)
    graph_safe = True  # scatter, bmm and elementwise ops only: nothing reads back to the host

    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        if problem.num_experts > 64:
            return f"dense evaluation of {problem.num_experts} experts would waste too much compute"
        return super()._supports_problem(problem, sku)

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        chunk = params["chunk_tokens"]
        w13, w2 = weights.w13, weights.w2
        num_experts = w13.shape[0]

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
            if out is None:
                out = torch.empty_like(x)
            for s in range(0, x.shape[0], chunk):
                xs, ids, tw = x[s:s + chunk], topk_ids[s:s + chunk], topk_weights[s:s + chunk]
                # (M, E) routing weight of each expert for each token, zero where not routed.
                dense_w = torch.zeros(xs.shape[0], num_experts, device=x.device)
                dense_w.scatter_add_(1, ids.long(), tw.float())
                inp = xs.unsqueeze(0).expand(num_experts, -1, -1)
                if problem.router_weight_on_input:
                    inp = (inp * dense_w.T.unsqueeze(2)).to(x.dtype)
                h = activate(torch.bmm(inp, w13.transpose(1, 2)), problem)
                y = torch.bmm(h, w2.transpose(1, 2)).float()  # (E, M, H)
                if problem.router_weight_on_input:
                    mask = (dense_w.T > 0).float().unsqueeze(2)
                    out[s:s + chunk] = (y * mask).sum(0).to(x.dtype)
                else:
                    out[s:s + chunk] = (y * dense_w.T.unsqueeze(2)).sum(0).to(x.dtype)
            return out

        return run
