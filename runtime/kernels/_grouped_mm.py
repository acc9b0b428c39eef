"""The Triton glue of ``moetune_grouped_mm``: what runs between torch's grouped GEMMs, each a
pass over rows in one launch, with routing on the device (no host sync, so graph-safe).

1. ``_gather``: row i of the expert-sorted input is the token row of sorted pair i (times its
   router weight when that applies on the input); it also records where pair i went
   (``position``), the inverse permutation the last pass reads.
2. ``_activate``: the activation of GEMM1's gate half times its up half (or of all of it where
   the layer is not gated), one row per program.
3. ``_weighted_sum``: each token's output row, the sum over its top-k pairs of GEMM2's rows
   times their router weights, in float32 and in slot order (deterministic: no atomics).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moetune.runtime.kernels._act_triton import act_code, gated_act
from moetune.runtime.kernels._align import align
from moetune.runtime.kernels.base import MoEFn, MoEWeights
from moetune.runtime.problem import MoEProblem

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: Elements of a row one step of a glue pass moves: 16 bytes per thread at 4 warps in bf16.
BLOCK = 1024


@triton.jit
def _gather(x_ptr, sorted_ptr, tw_ptr, rows_ptr, position_ptr, H, stride_xm, stride_rm,
            TOPK: tl.constexpr, ON_INPUT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    pair = tl.load(sorted_ptr + i)
    tl.store(position_ptr + pair, i)
    src = x_ptr + (pair // TOPK).to(tl.int64) * stride_xm
    dst = rows_ptr + tl.cast(i, tl.int64) * stride_rm
    if ON_INPUT:
        weight = tl.load(tw_ptr + pair).to(tl.float32)
    for first in range(0, H, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        row = tl.load(src + offs, mask=offs < H, other=0.0)
        if ON_INPUT:
            row = (row.to(tl.float32) * weight).to(row.dtype)
        tl.store(dst + offs, row, mask=offs < H)


@triton.jit
def _activate(g_ptr, h_ptr, I, stride_gm, stride_hm, GATED: tl.constexpr, ACT: tl.constexpr,
              BLOCK: tl.constexpr):
    row = tl.cast(tl.program_id(0), tl.int64)
    src = g_ptr + row * stride_gm
    dst = h_ptr + row * stride_hm
    for first in range(0, I, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        mask = offs < I
        gate = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        up = gate
        if GATED:
            up = tl.load(src + I + offs, mask=mask, other=0.0).to(tl.float32)
        act = gated_act(gate, up, ACT, GATED)
        tl.store(dst + offs, act.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_sum(y_ptr, position_ptr, tw_ptr, out_ptr, H, stride_ym, stride_om,
                  TOPK: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    dst = out_ptr + tl.cast(token, tl.int64) * stride_om
    for first in range(0, H, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        mask = offs < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for slot in tl.static_range(TOPK):
            pair = token * TOPK + slot
            row = tl.load(position_ptr + pair).to(tl.int64)
            part = tl.load(y_ptr + row * stride_ym + offs, mask=mask, other=0.0).to(tl.float32)
            if MUL_WEIGHT:
                part = part * tl.load(tw_ptr + pair).to(tl.float32)
            acc += part
        tl.store(dst + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def launcher(problem: MoEProblem, weights: MoEWeights) -> MoEFn:
    """The prepared call: routing sorted by expert (``align`` with one-row blocks: no padding),
    the gather, GEMM1, the activation, GEMM2 and the weighted sum."""
    num_experts, hidden, inter = weights.w2.shape
    w13_t, w2_t = weights.w13.transpose(1, 2), weights.w2.transpose(1, 2)  # x @ w per group
    # An expert's rows end where the sorted expert ids first exceed it: no host sync.
    ends = torch.arange(1, num_experts + 1, dtype=torch.int32, device=w13_t.device)
    act = act_code(problem)
    on_input = problem.router_weight_on_input

    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        m, topk = topk_ids.shape
        pairs = m * topk
        x = x if x.stride(1) == 1 else x.contiguous()
        weights_flat = topk_weights.reshape(-1)
        routing = align(topk_ids, 1, num_experts)
        offsets = torch.searchsorted(routing.expert_ids, ends, out_int32=True)
        rows = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
        position = torch.empty(pairs, dtype=torch.int32, device=x.device)
        _gather[(pairs,)](x, routing.sorted_token_ids, weights_flat, rows, position, hidden,
                          x.stride(0), rows.stride(0), TOPK=topk, ON_INPUT=on_input,
                          BLOCK=BLOCK)
        gate_up = torch._grouped_mm(rows, w13_t, offs=offsets)
        h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
        _activate[(pairs,)](gate_up, h, inter, gate_up.stride(0), h.stride(0),
                            GATED=problem.gated, ACT=act, BLOCK=BLOCK)
        y = torch._grouped_mm(h, w2_t, offs=offsets)
        if out is None:
            out = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
        _weighted_sum[(m,)](y, position, weights_flat, out, hidden, y.stride(0), out.stride(0),
                            TOPK=topk, MUL_WEIGHT=not on_input, BLOCK=BLOCK)
        return out

    return run
