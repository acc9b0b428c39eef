"""FlashInfer's CUTLASS fused MoE (``flashinfer.fused_moe.cutlass_fused_moe``), called as vLLM's
``FlashInferExperts.apply`` calls it (``experts/flashinfer_cutlass_moe.py``).

Whole layer in one call: FlashInfer permutes, runs CUTLASS grouped GEMMs (for 128x128 block fp8
on Hopper, its DeepSeek block-scale path, which quantizes the activations itself), applies
SwiGLU and reduces. FlashInfer JIT-compiles its CUTLASS MoE module for the device's arch with
nvcc on first use (``fused_moe_90`` on Hopper, one module for every dtype), and its first call
here picks the CUTLASS tactics with FlashInfer's autotuner, as vLLM's warm-up does.

Weights: vLLM's fp8 method prepares them for that backend (``prepare_fp8_moe_layer_for_fi``):
w13's halves swapped to [up; gate] (``swap_w13_to_w31``, block scales likewise), block scales
clamped to at least 1e-10 (the CUTLASS kernel gives NaN on Hopper for near-zero scales), and
unquantized intermediate sizes padded to 16 (here required instead). ``prepare`` makes that
layout (``WeightLayout.FLASHINFER_W31``) from moetune's plain weights, a copy of w13: a layer
vLLM gave ``TritonExperts`` holds plain weights, so the dispatcher does not serve this kernel
there. vLLM's oracle picks ``FlashInferExperts`` for block fp8 on Hopper under expert
parallelism (ranked first there), and for unquantized layers only where FlashInfer is asked for.

Not installed here; ``scripts/vllm_device_pack.py --flashinfer`` carries ``flashinfer-python``
0.7.2.post1 to the GPU machine with the two small wheels its import needs beyond vLLM's (16 MB;
docs/vllm.md).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights, WeightLayout
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import Activation, DType, MoEProblem, QuantScheme

#: vLLM's ``_FI_CUTLASS_MIN_BLOCK_SCALE``.
MIN_BLOCK_SCALE = 1e-10


def to_w31(w: torch.Tensor) -> torch.Tensor:
    """(E, 2I, ...) gate rows then up rows -> up rows then gate rows (vLLM's
    ``swap_w13_to_w31``; for block scales, rows of blocks)."""
    return w.reshape(w.shape[0], 2, w.shape[1] // 2, *w.shape[2:]).flip(1).reshape(w.shape)


class FlashInferCutlassKernel(BaseKernel):
    """FlashInfer's ``cutlass_fused_moe``, gated SiLU (its ``Swiglu``) on w31 weights."""

    name = "flashinfer_cutlass"
    layout = WeightLayout.FLASHINFER_W31
    #: Timed beside the rule by ``scripts/bench_vllm_baseline.py --also``, not tuned into tables:
    #: no layer the plugin serves holds this layout, and a bucket whose winner a layer cannot
    #: run goes back to vLLM's pick (``Dispatcher._decide``), losing a plain-layout winner.
    candidate = False
    vendors = frozenset({Vendor.NVIDIA})
    #: ``FlashInferExperts._supports_current_device``: sm_90 exactly, or the sm_100/sm_120
    #: families; FlashInfer's block-scale path raises off sm_90 (``_supports_problem``).
    min_sm = 90
    requires = ("flashinfer",)
    #: ``_supports_quant_scheme``: unquantized, and block fp8 with dynamic 1x128 activations;
    #: its fp8 per-tensor pair has static activation scales, moetune's per-tensor has dynamic.
    quants = frozenset({QuantScheme.NONE, QuantScheme.FP8_BLOCK_128X128})
    dtypes = frozenset({DType.FLOAT16, DType.BFLOAT16})
    activations = frozenset({Activation.SILU})
    gated = True
    #: vLLM applies the router weight to the output only with this class.
    router_weight_on_input = False
    #: vLLM pads unquantized w13 to 16 rows a half (``align_moe_weights_for_fi``).
    intermediate_align = 16
    compiles = True

    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        reason = super()._supports_problem(problem, sku)
        if reason:
            return reason
        if problem.quant is QuantScheme.FP8_BLOCK_128X128:
            if sku.sm != 90:
                return f"FlashInfer's fp8 block-scale MoE runs on sm_90 only, device is {sku.arch}"
            if problem.dtype is not DType.BFLOAT16:
                return "FlashInfer's fp8 block-scale MoE takes bfloat16 activations only"
        return None

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        from flashinfer.autotuner import autotune
        from flashinfer.fused_moe import ActivationType, cutlass_fused_moe

        block = problem.quant is QuantScheme.FP8_BLOCK_128X128
        w13, w2 = to_w31(weights.w13).contiguous(), weights.w2
        scales = []
        if block:
            scales = [to_w31(weights.w13_scale).clamp(min=MIN_BLOCK_SCALE).contiguous(),
                      weights.w2_scale.clamp(min=MIN_BLOCK_SCALE)]
        dtype = getattr(torch, problem.dtype.value)
        tuned = False

        def fn(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
            nonlocal tuned
            # vLLM's warm-up runs FlashInfer's ops once under its autotuner (on by default from
            # sm_90, ``kernel_warmup.flashinfer_autotune``): each power-of-two token count up to
            # 8192 gets its fastest CUTLASS tactics, and a call takes those of the largest such
            # count not above its own. Without it FlashInfer runs its heuristic's tactic. The
            # first call here tunes the same way (eagerly: the timer's warm-up calls come first).
            with contextlib.nullcontext() if tuned else autotune(True):
                result = cutlass_fused_moe(
                    input=x, token_selected_experts=topk_ids.to(torch.int),
                    token_final_scales=topk_weights, fc1_expert_weights=w13,
                    fc2_expert_weights=w2, output_dtype=dtype, quant_scales=scales, output=out,
                    use_deepseek_fp8_block_scale=block, activation_type=ActivationType.Swiglu)
            tuned = True
            return out if out is not None else result

        return fn
