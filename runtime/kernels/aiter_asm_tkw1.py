"""aiter's ``asm_moe_tkw1``: one asm kernel for fp8 per-channel layers whose top-1 router weight
applies on the input (Llama-4), the path vLLM takes for exactly that case.

The kernel applies the router weight after the first GEMM, quantizes activations per token
itself, and sorts with a fixed 32-row tile; it has no tunable parameter.
"""

from __future__ import annotations

from typing import Any

import torch

from moetune.runtime.kernels._aiter_asm import (
    AiterCall, BaseAiterKernel, aiter_function, aiter_weights, import_aiter)
from moetune.runtime.kernels.aiter_fused_moe import ACTIVATION_TYPES
from moetune.runtime.kernels.base import MoEFn, MoEWeights, write
from moetune.runtime.problem import MoEProblem, QuantScheme


class AiterAsmTkw1Kernel(BaseAiterKernel):
    """fp8 per-channel, top-1, router weight on input; nothing else."""

    name = "aiter_asm_tkw1"
    quants = frozenset({QuantScheme.FP8_PER_CHANNEL})
    aiter_call: AiterCall = ("aiter.fused_moe_bf16_asm", "asm_moe_tkw1",
                             ("fc1_scale", "fc2_scale", "activation"))

    @classmethod
    def _supports_routing(cls, problem: MoEProblem) -> str | None:
        if not problem.router_weight_on_input or problem.topk != 1:
            return "runs top-1 routing with the router weight on the input only"
        return None

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        aiter = import_aiter()
        asm_moe_tkw1 = aiter_function(cls.aiter_call)
        w13, w2, w13_scale, w2_scale = aiter_weights(weights)
        activation = getattr(aiter.ActivationType, ACTIVATION_TYPES[problem.activation])

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
            return write(asm_moe_tkw1(x, w13, w2, topk_weights.float(), topk_ids.to(torch.int32),
                                      fc1_scale=w13_scale, fc2_scale=w2_scale,
                                      activation=activation), out)

        return run
