"""vLLM's own Triton fused-MoE path (``runtime/vllm/triton.py``), run as vLLM runs a layer.

This is what vLLM serves unquantized and fp8 MoE layers with on CUDA under tensor parallelism,
so it is the CUDA rule's pick wherever vLLM's code and compiled ops are here: every CUDA winner
is timed against vLLM's kernel, configs and glue of the installed version. It has no
parameters: vLLM chooses its configs itself, from its tuned files (and in 0.34 GEMM2's
``_down.json``) or its default heuristic, which ``RuleChoice.configs`` names.
"""

from __future__ import annotations

from typing import Any

import torch

from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights, write
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import Activation, DType, MoEProblem, QuantScheme
from moetune.runtime.vllm.triton import layer, vllm_triton


class VllmTritonKernel(BaseKernel):
    """vLLM's ``TritonExperts`` in its modular kernel, behind its no-DP prepare step."""

    name = "vllm_triton"
    vendors = frozenset({Vendor.NVIDIA})
    quants = frozenset({QuantScheme.NONE, QuantScheme.FP8_PER_TENSOR,
                        QuantScheme.FP8_PER_CHANNEL, QuantScheme.FP8_BLOCK_128X128})
    dtypes = frozenset({DType.FLOAT16, DType.BFLOAT16})
    #: The serving-relevant path; vLLM's gated GELU is its exact erf form, not compared here.
    activations = frozenset({Activation.SILU})
    gated = True
    #: Captured in CUDA graphs as vLLM's engine captures it: no host sync in the path.
    graph_safe = True
    compiles = True

    @classmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        return super()._supports_device(problem, sku) or vllm_triton()[1]

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
        run = layer(problem, weights.w13, weights.w2, weights.w13_scale, weights.w2_scale)

        def fn(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
            return write(run(x, topk_weights, topk_ids), out)

        return fn
