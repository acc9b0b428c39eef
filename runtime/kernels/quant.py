"""fp8 (e4m3fn) weight quantization for each scheme, and its inverse for the reference."""

from __future__ import annotations

import torch

from moetune.runtime.kernels.base import MoEWeights
from moetune.runtime.problem import QuantScheme

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BLOCK = 128


def quantize_fp8(w: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize expert weights (E, N, K) to fp8; returns (q, scale) with ``w ~= q * scale``.

    Scale shapes: per-tensor (E,), per-channel (E, N), block (E, ceil(N/128), ceil(K/128)).
    """
    w = w.float()
    if scheme is QuantScheme.FP8_PER_TENSOR:
        scale = w.abs().amax(dim=(1, 2)).clamp(min=1e-12) / FP8_MAX
        return (w / scale[:, None, None]).to(FP8), scale
    if scheme is QuantScheme.FP8_PER_CHANNEL:
        scale = w.abs().amax(dim=2).clamp(min=1e-12) / FP8_MAX
        return (w / scale[:, :, None]).to(FP8), scale
    if scheme is QuantScheme.FP8_BLOCK_128X128:
        e, n, k = w.shape
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        padded = torch.zeros(e, nb * BLOCK, kb * BLOCK, dtype=w.dtype, device=w.device)
        padded[:, :n, :k] = w
        blocks = padded.view(e, nb, BLOCK, kb, BLOCK)
        scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / FP8_MAX
        q = (blocks / scale[:, :, None, :, None]).view(e, nb * BLOCK, kb * BLOCK)[:, :n, :k]
        return q.contiguous().to(FP8), scale
    raise ValueError(f"not an fp8 scheme: {scheme.value}")


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype``, for all experts (q: (E, N, K), scales as ``quantize_fp8``
    returns them) or one (q: (N, K), scale: that expert's ``scale[e]``).

    The product is formed in float32 and rounded to ``dtype`` once.
    """
    w = q.float()
    if scheme is QuantScheme.FP8_PER_TENSOR:
        w = w * scale.float()[..., None, None]
    elif scheme is QuantScheme.FP8_PER_CHANNEL:
        w = w * scale.float()[..., :, None]
    elif scheme is QuantScheme.FP8_BLOCK_128X128:
        n, k = w.shape[-2:]
        full = scale.float().repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
        w = w * full[..., :n, :k]
    else:
        raise ValueError(f"not an fp8 scheme: {scheme.value}")
    return w.to(dtype)


def quantize_weights(w13: torch.Tensor, w2: torch.Tensor, scheme: QuantScheme) -> MoEWeights:
    """Weights in ``scheme``: unchanged for ``none``, fp8 plus scales otherwise."""
    if scheme is QuantScheme.NONE:
        return MoEWeights(w13, w2)
    q13, s13 = quantize_fp8(w13, scheme)
    q2, s2 = quantize_fp8(w2, scheme)
    return MoEWeights(q13, q2, scheme, s13, s2)


def dequantize(weights: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 (w13, w2) as the quantized weights represent them."""
    if weights.quant is QuantScheme.NONE:
        return weights.w13.float(), weights.w2.float()
    assert weights.w13_scale is not None and weights.w2_scale is not None
    return (dequantize_fp8(weights.w13, weights.w13_scale, weights.quant),
            dequantize_fp8(weights.w2, weights.w2_scale, weights.quant))
