"""Dynamic fp8 quantization of activations in one launch: per token (a row is one group) or per
token group (128 columns, for block-fp8 weights). Zero rows get a tiny scale, not a NaN."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8).max


@triton.jit
def _quant_kernel(x_ptr, q_ptr, scale_ptr, stride_x, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                  GROUPS_POW2: tl.constexpr, GROUP_POW2: tl.constexpr, FP8_MAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS_POW2)
    c = tl.arange(0, GROUP_POW2)
    offs = g[:, None] * GROUP + c[None, :]
    mask = (g[:, None] < GROUPS) & (c[None, :] < GROUP)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / FP8_MAX
    q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * (GROUPS * GROUP) + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * GROUPS + g, scale, mask=g < GROUPS)


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 ``q`` (M, K) and float32 ``scale`` (M, K // group) with ``x ~= q * scale`` per group;
    ``group=None`` is one group per row. ``x`` must have unit column stride."""
    rows, cols = x.shape
    group = group or cols
    assert x.stride(1) == 1 and cols % group == 0, "quantize_rows needs unit column stride and whole groups"
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, cols // group), dtype=torch.float32, device=x.device)
    groups = cols // group
    width = triton.next_power_of_2(groups) * triton.next_power_of_2(group)
    _quant_kernel[(rows,)](x, q, scale, x.stride(0), GROUPS=groups, GROUP=group,
                           GROUPS_POW2=triton.next_power_of_2(groups),
                           GROUP_POW2=triton.next_power_of_2(group), FP8_MAX=_FP8_MAX,
                           num_warps=8 if width >= 8192 else 4)
    return q, scale
