"""The common part of kernels that are one of vLLM's experts classes run as vLLM runs a layer
(``runtime/vllm``'s ``layer`` builders: the class in vLLM's modular kernel behind its no-DP
prepare step): what vLLM's prepare step allows, and the prepared callable around the layer."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch

from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights, write
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem
from moetune.runtime.vllm.triton import LayerFn


class VllmLayerKernel(BaseKernel):
    """MUST set ``build``: ``runtime/vllm``'s builder of the layer, as a staticmethod."""

    vendors = frozenset({Vendor.NVIDIA})
    #: Captured in CUDA graphs as vLLM's engine captures it: no host sync in the path.
    graph_safe = True
    compiles = True
    build: ClassVar[Callable[..., LayerFn]]

    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        reason = super()._supports_problem(problem, sku)
        if reason:
            return reason
        if problem.router_weight_on_input and problem.topk != 1:
            return "vLLM applies the router weight on the input for top-1 routing only"
        return None

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        run = cls.build(problem, weights.w13, weights.w2, weights.w13_scale, weights.w2_scale)

        def fn(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
            return write(run(x, topk_weights, topk_ids), out)

        return fn
