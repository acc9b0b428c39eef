"""aiter's unified MoE entry point, ``aiter.fused_moe.fused_moe``: what vLLM's ``AiterExperts``
runs on ROCm for every scheme but tkw1.

Inside, aiter picks 1-stage asm or 2-stage asm/CK kernels from its ``tuned_fmoe.csv`` (exact
key match) or its heuristics. The one knob it takes from outside is ``block_size_M``, the
routing-sort tile; ``0`` leaves it to aiter (its table's ``block_m`` or its heuristic).
"""

from __future__ import annotations

from typing import Any

import torch

from moetune.runtime.kernels._aiter_asm import (
    AiterCall, BaseAiterKernel, aiter_function, aiter_weights, import_aiter)
from moetune.runtime.kernels.base import MoEFn, MoEWeights, Param, write
from moetune.runtime.problem import Activation, MoEProblem, QuantScheme

#: Our scheme -> aiter ``QuantType`` member, as vLLM maps it (block 128x128 is ``per_128x128``,
#: which aiter remaps to ``per_1x128``; per-channel weights run with per-token activations).
QUANT_TYPES = {
    QuantScheme.NONE: "No",
    QuantScheme.FP8_PER_TENSOR: "per_Tensor",
    QuantScheme.FP8_PER_CHANNEL: "per_Token",
    QuantScheme.FP8_BLOCK_128X128: "per_128x128",
}
ACTIVATION_TYPES = {Activation.SILU: "Silu", Activation.GELU: "Gelu"}


class AiterFusedMoeKernel(BaseAiterKernel):
    """aiter's own dispatch with the sort tile as the tuned parameter."""

    name = "aiter_fused_moe"
    params = (Param("block_size_M", (0, 16, 32, 64, 128)),)
    quants = frozenset(QUANT_TYPES)
    aiter_call: AiterCall = ("aiter.fused_moe", "fused_moe", (
        "activation", "quant_type", "doweight_stage1", "w1_scale", "w2_scale", "block_size_M"))

    @classmethod
    def _supports_routing(cls, problem: MoEProblem) -> str | None:
        if problem.router_weight_on_input and problem.quant is QuantScheme.FP8_BLOCK_128X128:
            return "router weight on input is not supported with block-scaled fp8 (vLLM asserts)"
        return super()._supports_routing(problem)

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        aiter = import_aiter()
        fused_moe = aiter_function(cls.aiter_call)
        w13, w2, w13_scale, w2_scale = aiter_weights(weights)
        activation = getattr(aiter.ActivationType, ACTIVATION_TYPES[problem.activation])
        quant_type = getattr(aiter.QuantType, QUANT_TYPES[problem.quant])
        block_m = params["block_size_M"] or None  # None: aiter decides
        on_input = problem.router_weight_on_input

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
            return write(fused_moe(x, w13, w2, topk_weights.float(), topk_ids.to(torch.int32),
                                   activation=activation, quant_type=quant_type,
                                   doweight_stage1=on_input, w1_scale=w13_scale,
                                   w2_scale=w2_scale, block_size_M=block_m), out)

        return run
