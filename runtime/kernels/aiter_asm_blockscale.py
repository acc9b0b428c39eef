"""aiter's ``asm_moe`` with ``block_shape=(128, 128)``: the one-stage asm kernel for block-scaled
fp8 (``fmoe_fp8_blockscale_g1u1``), vLLM's original block-fp8 path on ROCm.

``asm_moe`` asserts bfloat16 activations and float8_e4m3fnuz weights, so it runs on gfx942
only (gfx950's fp8 is e4m3fn); it quantizes activations per 128 columns in torch, never passes
an activation type (the kernel runs SiLU), and needs the intermediate size in 256-wide tiles.
"""

from __future__ import annotations

from typing import Any

import torch

from moetune.runtime.kernels._aiter_asm import (
    AiterCall, BaseAiterKernel, aiter_function, aiter_weights)
from moetune.runtime.kernels.base import MoEFn, MoEWeights, write
from moetune.runtime.problem import Activation, DType, MoEProblem, QuantScheme

BLOCK_SHAPE = (128, 128)


class AiterAsmBlockscaleKernel(BaseAiterKernel):
    """Block-scaled fp8, bfloat16, gated SiLU, on gfx942."""

    name = "aiter_asm_blockscale"
    amd_archs = ("gfx942",)
    quants = frozenset({QuantScheme.FP8_BLOCK_128X128})
    dtypes = frozenset({DType.BFLOAT16})
    activations = frozenset({Activation.SILU})
    router_weight_on_input = False
    intermediate_align = 256  # the blockscale kernel's tile of I
    aiter_call: AiterCall = ("aiter.fused_moe_bf16_asm", "asm_moe",
                             ("fc1_scale", "fc2_scale", "block_shape"))

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        asm_moe = aiter_function(cls.aiter_call)
        w13, w2, w13_scale, w2_scale = aiter_weights(weights)

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
            return write(asm_moe(x, w13, w2, topk_weights.float(), topk_ids.to(torch.int32),
                                 fc1_scale=w13_scale, fc2_scale=w2_scale,
                                 block_shape=BLOCK_SHAPE), out)

        return run
