"""Dynamic fp8 quantization of activations in one launch: per token (a row is one group) or per
token group (128 columns, for block-fp8 weights). Zero rows get a tiny scale, not a NaN."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


#: Elements one program quantizes: a row of a narrow activation (GEMM2's input at I = 256 is
#: two groups) is too little work for a program, so several rows share one.
PROGRAM_ELEMENTS = 4096


@triton.jit
def _quant_kernel(x_ptr, q_ptr, scale_ptr, rows, used_ptr, stride_x, ROWS: tl.constexpr,
                  GROUPS: tl.constexpr, GROUP: tl.constexpr, GROUPS_POW2: tl.constexpr,
                  GROUP_POW2: tl.constexpr, FP8_MAX: tl.constexpr, USED: tl.constexpr):
    """``ROWS`` rows from ``program_id * ROWS``, as (ROWS * GROUPS_POW2) groups of one tile;
    with ``USED`` only the rows before the count at ``used_ptr``."""
    if USED:
        rows = tl.minimum(rows, tl.load(used_ptr))
        if tl.program_id(0) * ROWS >= rows:
            return
    i = tl.arange(0, ROWS * GROUPS_POW2)
    row = tl.program_id(0).to(tl.int64) * ROWS + i // GROUPS_POW2
    g = i % GROUPS_POW2
    c = tl.arange(0, GROUP_POW2)
    live = (row < rows) & (g < GROUPS)
    mask = live[:, None] & (c[None, :] < GROUP)
    col = g[:, None] * GROUP + c[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / FP8_MAX
    q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row[:, None] * (GROUPS * GROUP) + col, q.to(q_ptr.dtype.element_ty),
             mask=mask)
    tl.store(scale_ptr + row * GROUPS + g, scale, mask=live)


def quantize_rows(x: torch.Tensor, group: int | None = None,
                  used: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 ``q`` (M, K) and float32 ``scale`` (M, K // group) with ``x ~= q * scale`` per group;
    ``group=None`` is one group per row. ``x`` must have unit column stride. ``used``: a device
    scalar counting the leading rows that hold data (a padded layout's rows past it are left
    unwritten), read by the kernel so the host never waits for it."""
    rows, cols = x.shape
    group = group or cols
    assert x.stride(1) == 1 and cols % group == 0, "quantize_rows needs unit column stride and whole groups"
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, cols // group), dtype=torch.float32, device=x.device)
    groups = cols // group
    width = triton.next_power_of_2(groups) * triton.next_power_of_2(group)
    per_program = max(1, PROGRAM_ELEMENTS // width)
    _quant_kernel[(triton.cdiv(rows, per_program),)](
        x, q, scale, rows, x if used is None else used, x.stride(0), ROWS=per_program,
        GROUPS=groups, GROUP=group, GROUPS_POW2=triton.next_power_of_2(groups),
        GROUP_POW2=triton.next_power_of_2(group), FP8_MAX=FP8_MAX, USED=used is not None,
        num_warps=8 if width >= 8192 else 4)
    return q, scale
