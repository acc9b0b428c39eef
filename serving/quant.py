"""A vLLM MoE layer's quantization as moetune tunes it: the ``QuantScheme`` its
``FusedMoEQuantConfig`` declares, and its weight scales in moetune's layout.

vLLM's fp8 MoE methods (``quantization/fp8.py`` ``Fp8MoEMethod``, the online and
compressed-tensors ones) keep the scales as ``w13_weight_scale`` (per tensor: (E,); per channel:
(E, N, 1)) or ``w13_weight_scale_inv`` (per 128x128 block: (E, N/128, K/128)), and ``w2_...``
alike; the quant config an experts object holds references those tensors as
``w1_scale``/``w2_scale``. moetune's kernels take (E,), (E, N) and (E, N/128, K/128) float32
(``kernels/quant.py``), so per-channel scales are viewed without their trailing 1.

Only what moetune's kernels compute the same way is described: fp8 e4m3 weights in one of the
tuned schemes, with activations that reach the experts unquantized (vLLM's W8A16 CPU kernel, an
experts class that quantizes them itself, or one the hook can make do so: ``defers``) and no
static activation scales.
"""

from __future__ import annotations

from typing import Any

import torch

from moetune.runtime.problem import QuantScheme

_FP8 = torch.float8_e4m3fn
_PER_TENSOR, _PER_ROW = (-1, -1), (1, -1)  # vLLM's GroupShape.PER_TENSOR and PER_TOKEN


def weight_quant(experts: Any, w13: torch.Tensor, w2: torch.Tensor, defers: bool = False
                 ) -> tuple[QuantScheme | None, tuple[torch.Tensor, torch.Tensor] | None, str]:
    """The scheme of ``experts.quant_config`` and its (w13, w2) scales in moetune's layout
    (None for unquantized layers), or None, None and why moetune leaves the layer to vLLM.

    The weights' groups are read as vLLM's kernels read them: a block from the weight
    descriptor (``_w1.shape``, as ``CPUExpertsFp8.apply`` does: for W8A16 configs
    ``block_shape``, the activations', is None), per channel where it says so, else from the
    scales' layout, per tensor or per channel (as vLLM's ``_humming_fp8_weight_schema`` does).
    """
    qc = experts.quant_config
    if qc.weight_quant_dtype is None and not qc.is_quantized:
        return QuantScheme.NONE, None, ""
    why = unsupported(experts, defers)
    if why:
        return None, None, why
    group = None if qc._w1.shape is None else tuple(qc._w1.shape)
    if group == _PER_ROW:
        scheme = QuantScheme.FP8_PER_CHANNEL
    elif group not in (None, _PER_TENSOR):
        if group != (128, 128):
            return None, None, f"fp8 block {group[0]}x{group[1]}"
        scheme = QuantScheme.FP8_BLOCK_128X128
    elif isinstance(qc.w1_scale, torch.Tensor) and qc.w1_scale.numel() == w13.shape[0]:
        scheme = QuantScheme.FP8_PER_TENSOR
    else:
        scheme = QuantScheme.FP8_PER_CHANNEL
    scales = []
    for name, scale, weight in (("w13", qc.w1_scale, w13), ("w2", qc.w2_scale, w2)):
        if weight.dtype != _FP8:
            return None, None, f"{name} weights are {weight.dtype}, not {_FP8}"
        want = _scale_shape(scheme, weight.shape)
        if (not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32
                or tuple(scale.shape) not in (want, want + (1,))):
            got = (tuple(scale.shape), scale.dtype) if isinstance(scale, torch.Tensor) else scale
            return None, None, f"{name} scales {got} are not {scheme.value} float32 scales {want}"
        scales.append(scale.reshape(want))
    return scheme, (scales[0], scales[1]), ""


def unsupported(experts: Any, defers: bool = False) -> str:
    """Why moetune's kernels do not compute this quantized layer as vLLM does ("" if they do):
    weights other than fp8 e4m3, static activation scales, or activations vLLM quantized
    (unless ``defers``: the hook can make the class take them unquantized)."""
    qc = experts.quant_config
    if qc.weight_quant_dtype != _FP8:
        return f"quantized ({qc.weight_quant_dtype})"
    if qc.a1_scale is not None or qc.a2_scale is not None:
        return "static activation scales (moetune's kernels quantize dynamically)"
    if qc.quant_dtype is not None and not (defers or experts.expects_unquantized_inputs):
        return "activations reach the experts quantized to fp8 by vLLM"
    return ""


def quantize_input(quant_config: Any, hidden_states: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The activations and their scales as vLLM's prepare step quantizes them for a layer of
    ``quant_config``: its own ``_quantize_input`` (``prepare_finalize/no_dp_ep.py``; 0.33 added
    ``is_scale_transposed`` to what it passes), for vLLM's kernels in a layer whose prepare
    step the hook made hand them over unquantized."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import _quantize_input

    return _quantize_input(hidden_states, quant_config)


def _scale_shape(scheme: QuantScheme, weight: torch.Size) -> tuple[int, ...]:
    e, n, k = weight
    if scheme is QuantScheme.FP8_PER_TENSOR:
        return (e,)
    if scheme is QuantScheme.FP8_PER_CHANNEL:
        return (e, n)
    return (e, -(-n // 128), -(-k // 128))
