"""vLLM's DeepGEMM experts (``runtime/vllm/deepgemm.py``): DeepGEMM's contiguous grouped fp8
GEMMs with vLLM's permute, fused SiLU-and-quantize and reduce, run as vLLM runs such a layer.

What it computes on: the weights vLLM's DEEPGEMM backend holds (``WeightLayout.DEEP_GEMM``),
made from moetune's plain ones once in ``prepare``. Under DeepGEMM's E8M0 scales (vLLM's default
wherever DeepGEMM runs) that is a requantized copy of the layer, so the kernel cannot serve a
layer vLLM gave ``TritonExperts`` (the automatic pick for block fp8 on Hopper under tensor
parallelism): the dispatcher refuses it there for its layout. The layers that do hold this
layout (``TritonOrDeepGemmExperts`` under E8M0) are left to vLLM, which runs DeepGEMM on every
call of theirs. So the family measures what vLLM's DeepGEMM backend would give against vLLM's
Triton pick and moetune's winners; it serves nothing yet.
"""

from __future__ import annotations

from moetune.runtime.kernels._vllm_layer import VllmLayerKernel
from moetune.runtime.kernels.base import WeightLayout
from moetune.runtime.platform import SKU
from moetune.runtime.problem import Activation, DType, MoEProblem, QuantScheme
from moetune.runtime.vllm.deepgemm import layer, shape_reason, vllm_deepgemm


class VllmDeepGemmKernel(VllmLayerKernel):
    """vLLM's ``DeepGemmExperts`` in its modular kernel, behind its no-DP prepare step."""

    name = "vllm_deepgemm"
    build = staticmethod(layer)
    layout = WeightLayout.DEEP_GEMM
    #: Timed beside the rule by ``scripts/bench_vllm_baseline.py --also``, not tuned into tables:
    #: no layer the plugin serves holds this layout, and a bucket whose winner a layer cannot
    #: run goes back to vLLM's pick (``Dispatcher._decide``), losing a plain-layout winner.
    candidate = False
    min_sm = 90
    #: ``_supports_quant_scheme``: 128x128 block-fp8 weights with dynamic 1x128 activations;
    #: its other pair (MXFP8 1x32) is Blackwell's, a scheme moetune has not.
    quants = frozenset({QuantScheme.FP8_BLOCK_128X128})
    #: DeepGEMM's grouped GEMMs write bfloat16 (vLLM's workspaces take the layer's dtype).
    dtypes = frozenset({DType.BFLOAT16})
    #: ``_supports_activation``: SiLU (and SwiGLU variants moetune has not); gated only
    #: (``_supports_no_act_and_mul`` is False).
    activations = frozenset({Activation.SILU})
    gated = True
    #: DeepGEMM JIT-compiles each GEMM shape with nvcc on its first call.
    compiles = True

    @classmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        return super()._supports_device(problem, sku) or vllm_deepgemm()[1]

    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        return super()._supports_problem(problem, sku) or shape_reason(problem)
