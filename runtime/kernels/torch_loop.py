"""Per-expert loop in the layer's dtype: gather each expert's tokens, two GEMMs, scatter-add."""

from __future__ import annotations

from typing import Any, Callable

import torch

from moetune.runtime.kernels._math import activate
from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights, write
from moetune.runtime.kernels.quant import dequantize_fp8
from moetune.runtime.problem import MoEProblem, QuantScheme

#: ``expert(e, dtype) -> (w1, w2)``: expert ``e``'s weights in ``dtype``.
ExpertWeights = Callable[[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


class TorchLoopKernel(BaseKernel):
    """The simplest correct kernel; few launches per expert, so it wins where experts are few.

    fp8 weights (every scheme) stay fp8: each routed expert is dequantized to the activation
    dtype when its tokens are computed (W8A16, as vLLM's CPU fp8 kernel), so no full-precision
    copy of the layer is ever held.
    """

    name = "torch_loop"
    #: One ``index_add_`` per expert, in expert order, and a token meets an expert at most once.
    deterministic = True
    quants = frozenset(QuantScheme)  # none, or fp8 dequantized per expert

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        expert = expert_weights(weights)
        num_experts = weights.w13.shape[0]
        on_input = problem.router_weight_on_input

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
            acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            flat_ids = topk_ids.reshape(-1)
            order = torch.argsort(flat_ids, stable=True)
            counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
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
                w1, w2 = expert(e, x.dtype)
                y = activate(inp @ w1.T, problem) @ w2.T
                acc.index_add_(0, tok, y.float() if on_input else y.float() * w)
            return write(acc, out, x.dtype)

        return run


def expert_weights(weights: MoEWeights) -> ExpertWeights:
    """Per-expert weight access: the stored tensors, or fp8 ones dequantized on each call."""
    w13, w2 = weights.w13, weights.w2
    if weights.quant is QuantScheme.NONE:
        return lambda e, dtype: (w13[e], w2[e])
    s13, s2, scheme = weights.w13_scale, weights.w2_scale, weights.quant
    if s13 is None or s2 is None:
        raise ValueError(f"{scheme.value} weights need w13_scale and w2_scale")
    return lambda e, dtype: (dequantize_fp8(w13[e], s13[e], scheme, dtype),
                             dequantize_fp8(w2[e], s2[e], scheme, dtype))
