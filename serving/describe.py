"""How moetune describes a vLLM MoE layer: its ``Shape``, or why it leaves the layer to vLLM.

Reads the experts object's ``moe_config`` and ``quant_config`` (vLLM's ``FusedMoEConfig`` and
``FusedMoEQuantConfig``; the quant scheme and scales through ``quant.weight_quant``), its biases
and the weight tensors' shapes, as plain attributes (no ``getattr`` defaults): an attribute vLLM
renamed raises, and the hook leaves the layer to vLLM saying so.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from moetune.runtime.kernels.base import MoEWeights
from moetune.runtime.problem import Activation, DType, Shape
from moetune.runtime.vllm.versions import VllmFacts
from moetune.serving.quant import unsupported, weight_quant

_DTYPES = {torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT16,
           torch.bfloat16: DType.BFLOAT16}
#: vLLM ``MoEActivation`` value -> (activation, gated).
_ACTIVATIONS = {"silu": (Activation.SILU, True), "gelu": (Activation.GELU, True),
                "silu_no_mul": (Activation.SILU, False), "gelu_no_mul": (Activation.GELU, False)}


def describe(experts: Any, w13: torch.Tensor, w2: torch.Tensor, on_input: bool,
             defers: bool = False) -> tuple[Shape | None, str]:
    """The layer's ``Shape``, or None and the reason moetune leaves it to vLLM (``defers``:
    the class can be made to quantize its activations itself, ``ExpertsSpec``)."""
    cfg, qc = experts.moe_config, experts.quant_config
    if cfg.moe_parallel_config.use_ep:
        # vLLM hands such a layer its rank's experts and an expert map (or tokens another rank
        # dispatched), which no moetune kernel takes: every call would fall back, and an fp8
        # layer switched to unquantized activations would make vLLM dispatch them in bf16.
        return None, "expert parallelism (each rank holds part of the experts)"
    if qc.is_quantized or qc.weight_quant_dtype is not None:
        why = unsupported(experts, defers)
        if why:
            return None, why
    if experts.w1_bias is not None or experts.w2_bias is not None:
        return None, "expert biases"
    if qc.gemm1_alpha is not None or qc.gemm1_clamp_limit is not None:
        return None, "clamped or scaled swiglu"
    act = _ACTIVATIONS.get(str(cfg.activation.value))
    dtype = _DTYPES.get(cfg.in_dtype)
    if act is None or dtype is None:
        return None, f"activation {cfg.activation.value}, dtype {cfg.in_dtype}"
    if w13.dim() != 3 or w2.dim() != 3:
        return None, f"weights of rank {w13.dim()}/{w2.dim()}"
    experts_n, rows, hidden = w13.shape
    inter = rows // 2 if act[1] else rows
    if tuple(w2.shape) != (experts_n, hidden, inter):
        return None, f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not match"
    quant, _, why = weight_quant(experts, w13, w2, defers)
    if quant is None:
        return None, why
    try:
        shape = Shape(hidden, inter, experts_n, int(cfg.experts_per_token), dtype,
                      quant, act[0], act[1], bool(on_input))
        shape.problem(1)
    except Exception as e:  # noqa: BLE001 - a shape moetune cannot describe is not ours
        return None, str(e)
    return shape, ""


def layer_weights(experts: Any, shape: Shape, w13: torch.Tensor, w2: torch.Tensor,
                  defers: bool = False) -> MoEWeights:
    """The weights moetune's kernels run for a layer ``describe`` gave ``shape``: ``w13`` and
    ``w2`` with, for fp8, vLLM's own scales in moetune's layout (views, not copies)."""
    _, scales, _ = weight_quant(experts, w13, w2, defers)
    return MoEWeights(w13, w2, shape.quant, *(scales or (None, None)))


def differs(experts: Any, cls: type, w13: torch.Tensor, w2: torch.Tensor,
            facts: VllmFacts) -> str:
    """Why vLLM's ``apply`` of this object computes something moetune's kernels do not, in the
    version of ``facts`` ("" if it computes what they do): a subclass or the object itself
    setting a finalize hook otherwise than ``cls`` (the hooked class) does, or weights vLLM reads
    from host memory in place (UVA offload), on which no moetune kernel was timed."""
    for name in facts.finalize_hooks:
        if inspect.getattr_static(experts, name, None) is not inspect.getattr_static(
                cls, name, None):
            return f"vLLM {facts.label} {name} differs from {cls.__name__}'s on this layer"
    if any(getattr(w, "_vllm_is_uva_offloaded", False) for w in (w13, w2)):
        return "weights are offloaded to host memory (UVA): no moetune kernel was timed there"
    return ""


def padded(experts: Any, facts: VllmFacts) -> bool:
    """Whether this layer's calls may carry padding rows (``topk_ids`` all -1, garbage
    activations) in the version of ``facts``: its all2all hands over ``PaddedStandard``."""
    if not facts.padded_rows:
        return False
    return str(experts.moe_config.activation_format.value[0]) == "padded_standard"
