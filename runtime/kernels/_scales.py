"""fp8 weight scales as moetune's Triton kernels read them: a scheme code (a ``tl.constexpr``)
and the scale tensor with its (expert, row or row block, column block) strides."""

from __future__ import annotations

import torch

from moetune.runtime.problem import QuantScheme

QUANT_NONE, QUANT_TENSOR, QUANT_CHANNEL, QUANT_BLOCK = 0, 1, 2, 3
#: The side of a block-fp8 scale block (rows and columns).
SCALE_BLOCK = 128

CODES = {QuantScheme.NONE: QUANT_NONE, QuantScheme.FP8_PER_TENSOR: QUANT_TENSOR,
         QuantScheme.FP8_PER_CHANNEL: QUANT_CHANNEL, QuantScheme.FP8_BLOCK_128X128: QUANT_BLOCK}


def scale_args(scale: torch.Tensor | None, w: torch.Tensor,
               quant: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A scale tensor and its (expert, row block or row, column block) strides: one per expert
    (per-tensor), per output row (per-channel) or per 128x128 block. Unquantized weights pass
    the weights themselves, never read.

    Raises:
        ValueError: fp8 weights without their scales.
    """
    if quant == QUANT_NONE:
        return w, (0, 0, 0)
    if scale is None:
        raise ValueError("fp8 weights need their scales (MoEWeights.w13_scale / w2_scale)")
    scale = scale.float().contiguous()
    strides = tuple(scale.stride()) + (0,) * (3 - scale.dim())
    return scale, strides  # type: ignore[return-value]
