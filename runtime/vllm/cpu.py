"""vLLM's CPU MoE pieces: its ops, its experts classes, and which class vLLM would run a layer
with on this CPU (as its unquantized and fp8 oracles choose), or why none would.

vLLM is optional: nothing is imported until a CPU problem asks (``vllm_cpu``).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from types import SimpleNamespace
from typing import Any

import torch

from moetune.runtime.problem import DType
from moetune.runtime.vllm.classes import CPU_UNQUANTIZED, IncompatibleVllm, cpu_experts

_OPS = ("cpu_fused_moe", "prepack_moe_weight")
_FP8_OPS = ("fused_experts_cpu", "convert_weight_packed")


@functools.cache
def vllm_cpu() -> tuple[SimpleNamespace | None, str | None]:
    """vLLM's CPU MoE pieces (ops, experts classes, activation enum), or why they are absent."""
    if importlib.util.find_spec("vllm") is None:
        return None, "vLLM is not installed"
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.kernels.linear.zentorch_utils import has_zentorch_op
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        from vllm.platforms import current_platform
    except Exception as e:  # noqa: BLE001 - any vLLM that differs makes the kernel ineligible
        return None, f"vLLM's CPU MoE could not be imported ({type(e).__name__}: {e})"
    if not current_platform.is_cpu():
        return None, f"vLLM here is not its CPU build (platform {type(current_platform).__name__})"
    missing = [op for op in _OPS if not hasattr(torch.ops._C, op)]
    if missing:
        return None, f"vLLM's CPU ops {', '.join(missing)} are not registered"
    try:
        classes = cpu_experts(*CPU_UNQUANTIZED)
    except IncompatibleVllm as e:
        return None, f"vLLM's CPU experts classes differ from what moetune knows ({e})"
    return SimpleNamespace(ops=ops, classes=classes, portable=classes[-1], cpu_moe=cpu_moe,
                           activation=MoEActivation, has_zentorch_op=has_zentorch_op), None


@functools.cache
def experts_class(dtype: DType, activation: str, gated: bool, hidden: int, on_input: bool,
                   topk: int) -> tuple[Any, str | None]:
    """The vLLM experts class that would run this layer here, or None and why none would."""
    vllm, why = vllm_cpu()
    if vllm is None:
        return None, why
    if not gated:
        return None, "vLLM's CPU experts run gated (act-and-mul) layers only"
    if on_input and topk != 1:
        return None, "vLLM applies the router weight on the input for top-1 routing only"
    try:
        act = vllm.activation(activation)
        if vllm.has_zentorch_op(["zentorch_fused_moe"]):
            return None, "vLLM runs zentorch's fused MoE on this CPU, not cpu_fused_moe"
        reasons = []
        for cls in vllm.classes:
            if not cls._supports_current_device():
                continue
            # The arch-specific classes' is_supported_config takes bfloat16 activations only.
            if cls is not vllm.portable and dtype is not DType.BFLOAT16:
                reasons.append(f"{cls.__name__} needs bfloat16")
                continue
            if not cls._supports_activation(act):
                reasons.append(f"{cls.__name__} does not run {activation}")
                continue
            if hidden % cls.output_alignment or hidden % cls.reduction_alignment:
                reasons.append(f"{cls.__name__} needs hidden divisible by "
                               f"{math.lcm(cls.output_alignment, cls.reduction_alignment)}")
                continue
            return cls, None
    except Exception as e:  # noqa: BLE001 - vLLM internals that differ: not eligible, say why
        return None, f"vLLM's CPU experts differ from what moetune knows ({type(e).__name__}: {e})"
    return None, "no vLLM CPU experts class runs this layer: " + "; ".join(reasons)


@functools.cache
def fp8_experts_class(dtype: DType, activation: str, gated: bool,
                       on_input: bool) -> tuple[Any, str | None]:
    """``CPUExpertsFp8`` if vLLM would run this block-fp8 layer with it here, else why not."""
    vllm, why = vllm_cpu()
    if vllm is None:
        return None, why
    try:
        cls, w8a8 = cpu_experts("CPUExpertsFp8", "CPUExpertsFp8W8A8")
        if not cls._supports_current_device():
            return None, "vLLM's CPUExpertsFp8 needs an x86 CPU with AMX; this one has none"
        if w8a8._supports_current_device():
            return None, "vLLM runs CPUExpertsFp8W8A8 on this AMX-FP8 CPU, not CPUExpertsFp8"
        missing = [op for op in _FP8_OPS if not hasattr(torch.ops._C, op)]
        if missing:
            return None, f"vLLM's CPU ops {', '.join(missing)} are not built for this CPU"
        if not gated:
            return None, "CPUExpertsFp8 runs gated (act-and-mul) layers only"
        if on_input:
            return None, "CPUExpertsFp8 does not apply the router weight on the input"
        if not cls._supports_activation(vllm.activation(activation)):
            return None, f"CPUExpertsFp8 does not run {activation}"
        if dtype is DType.FLOAT32:
            return None, "vLLM serves fp8 checkpoints with bfloat16 or float16 activations only"
    except Exception as e:  # noqa: BLE001 - vLLM internals that differ: not eligible, say why
        return None, (f"vLLM's CPU fp8 experts differ from what moetune knows "
                      f"({type(e).__name__}: {e})")
    return cls, None
