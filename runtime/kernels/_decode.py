"""The Triton kernels of ``moetune_decode``: a small-M MoE layer in two GEMV-like launches.

Each program owns one routed (token, slot) pair and reads its expert id straight from
``topk_ids``: nothing is sorted or aligned, and no program waits on another.

1. ``_gemm1_act``: grid (pairs, tiles of I). The gate and up rows of the pair's expert for one
   I-tile, over H in ``BLOCK_K`` chunks, accumulated in float32 against the token's row; then the
   router weight (when it applies on the input), the activation and the gate product. Writes the
   activated intermediate (pairs, I) in the compute dtype. Programs of slot 0 also zero the
   token's row of the buffer the second launch accumulates into (so no memset is launched).
2. ``_gemm2_reduce``: grid (pairs, tiles of H, SPLIT_K). The pair's W2 rows for one H-tile over
   its share of I, times the router weight, then one of: a store (top-1 without split-K: nothing
   to reduce), an atomic add into a float32 buffer or into the output itself, or a store of the
   partial into its own row (``_reduce_rows`` then sums the rows in a fixed order).

With ``PDL`` (Hopper's programmatic dependent launch) GEMM2 launches while GEMM1 still runs:
its programs have their weight rows brought into L2 (they do not depend on GEMM1), then wait
for GEMM1's results (``gdc_wait``), so the two launches overlap instead of running back to back.

A pair routed nowhere (``topk_ids`` -1: a padding row of a batch padded to a CUDA graph's size)
loops over nothing and reads no weights: GEMM1 stores nothing for it, and GEMM2 adds nothing
(atomics) or stores zeros where its row is read (the output at top-1, a partial row).

fp8 weights are dequantized in registers (weight-only: activations stay in the compute dtype).
Scales: per expert (``QUANT_TENSOR``), per output row (``QUANT_CHANNEL``) or per 128x128 block
(``QUANT_BLOCK``). For blocks a tile's rows must lie in one 128-row block (``BLOCK_N`` divides
128); its columns may span several: each column's scale is gathered with the activations.

``INTERPRET`` records whether Triton's CPU interpreter was on when these kernels were defined
(``triton.jit`` decides it then, so it cannot change for this process).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moetune.runtime.kernels._act_triton import act_code, gated_act
from moetune.runtime.kernels.base import MoEFn, MoEWeights
from moetune.runtime.kernels._scales import CODES, scale_args
from moetune.runtime.problem import DType, MoEProblem

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: What ``_gemm2_reduce`` does with a program's partial sum.
STORE, ATOMIC, PARTIAL = 0, 1, 2


@triton.jit
def gemm1_tile(x_ptr, w_ptr, s_ptr, tw_ptr, token, slot, expert, h_end, pid_n, H, I,
               stride_xm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
               stride_tm, stride_tk,
               GATED: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr,
               ON_INPUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One routed pair's activated GEMM1 rows ``pid_n * BLOCK_N ...`` (gate, and up when gated,
    against the token's activations over H; fp8 scales applied; the router weight when it is on
    the input), and their offsets. ``h_end`` is H, or 0 for a pair routed nowhere (no rows
    read). A GEMV in float32 registers: at decode sizes the weight reads are the cost."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    gate_ptrs = w_base + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    up_ptrs = gate_ptrs + I * stride_wn
    x_ptrs = x_ptr + token * stride_xm + offs_k
    s_base = s_ptr + expert * stride_se
    gate_block = (pid_n * BLOCK_N) // 128
    up_block = (I + pid_n * BLOCK_N) // 128
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, h_end, BLOCK_K):
        mask_k = offs_k < H - k
        x = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        mask = mask_n[:, None] & mask_k[None, :]
        x_gate = x
        if QUANT == 3:
            col_blocks = ((k + offs_k) // 128) * stride_sk
            x_gate = x * tl.load(s_base + gate_block * stride_sn + col_blocks, mask=mask_k,
                                 other=0.0)
        w = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        acc_gate += w * x_gate[None, :]
        if GATED:
            x_up = x
            if QUANT == 3:
                x_up = x * tl.load(s_base + up_block * stride_sn + col_blocks, mask=mask_k,
                                   other=0.0)
            w = tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32)
            acc_up += w * x_up[None, :]
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K
    gate = tl.sum(acc_gate, 1)
    up = tl.sum(acc_up, 1)
    if QUANT == 1:
        scale = tl.load(s_base)
        gate *= scale
        up *= scale
    if QUANT == 2:
        gate *= tl.load(s_base + offs_n * stride_sn, mask=mask_n, other=0.0)
        if GATED:
            up *= tl.load(s_base + (I + offs_n) * stride_sn, mask=mask_n, other=0.0)
    if ON_INPUT:  # (w * x) @ W == w * (x @ W): the weight scales the GEMM's output instead
        weight = tl.load(tw_ptr + token * stride_tm + slot * stride_tk).to(tl.float32)
        gate *= weight
        up *= weight
    return gated_act(gate, up, ACT, GATED), offs_n


@triton.jit
def _gemm1_act(x_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, h_ptr, zero_ptr,
               H, I, stride_xm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
               stride_im, stride_ik, stride_tm, stride_tk, stride_hm, stride_zm,
               TOPK: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr,
               ON_INPUT: tl.constexpr, ZERO: tl.constexpr, ZERO_BLOCK: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # GEMM2 may launch once every program here has started
        gdc_launch_dependents()
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = pair // TOPK
    slot = pair % TOPK
    expert = tl.load(ids_ptr + token * stride_im + slot * stride_ik).to(tl.int64)
    # A pair routed nowhere (id -1) reads expert 0's scales and no rows: its H loop is empty.
    routed = expert >= 0
    expert = tl.maximum(expert, 0)
    h_end = tl.where(routed, H, 0)

    if ZERO:  # this token's accumulator row, spread over the I-tiles of its first slot
        offs_z = pid_n * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
        zeros = tl.zeros([ZERO_BLOCK], dtype=zero_ptr.dtype.element_ty)
        zero_len = tl.where(slot == 0, H, 0)
        tl.store(zero_ptr + token * stride_zm + offs_z, zeros, mask=offs_z < zero_len)

    act, offs_n = gemm1_tile(x_ptr, w_ptr, s_ptr, tw_ptr, token, slot, expert, h_end, pid_n, H, I,
                             stride_xm, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
                             stride_sk, stride_tm, stride_tk,
                             GATED, ACT, QUANT, ON_INPUT, BLOCK_N, BLOCK_K)
    tl.store(h_ptr + pair * stride_hm + offs_n, act.to(h_ptr.dtype.element_ty),
             mask=offs_n < tl.where(routed, I, 0))


@triton.jit
def _gemm2_reduce(a_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, out_ptr,
                  H, I, k_per_split, stride_am, stride_we, stride_wn, stride_wk,
                  stride_se, stride_sn, stride_sk, stride_im, stride_ik, stride_tm, stride_tk,
                  stride_om,
                  TOPK: tl.constexpr, QUANT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                  MODE: tl.constexpr, SPLIT_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    token = pair // TOPK
    slot = pair % TOPK
    expert = tl.load(ids_ptr + token * stride_im + slot * stride_ik).to(tl.int64)
    # A pair routed nowhere reads no rows (an empty I loop) and contributes zeros: stored where
    # a row is stored, nothing added where atomics add.
    routed = expert >= 0
    expert = tl.maximum(expert, 0)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, I)
    loop_end = tl.where(routed, k_end, k_start)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + expert * stride_we + offs_n[:, None] * stride_wn
              + offs_k[None, :] * stride_wk)
    a_ptrs = a_ptr + pair * stride_am + offs_k
    s_base = s_ptr + expert * stride_se
    row_block = (pid_n * BLOCK_N) // 128
    if PDL:  # launched while GEMM1 runs: its weight rows are read into L2 before waiting on it
        rows = w_ptr + expert * stride_we + tl.minimum(offs_n, H - 1) * stride_wn
        _prefetch_l2(rows + k_start * stride_wk,
                     (k_end - k_start) * (w_ptr.dtype.element_ty.primitive_bitwidth // 8))
        gdc_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(k_start, loop_end, BLOCK_K):
        mask_k = offs_k < k_end - (k - k_start)
        a = tl.load(a_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        if QUANT == 3:
            col_blocks = ((k - k_start + offs_k) // 128) * stride_sk
            a = a * tl.load(s_base + row_block * stride_sn + col_blocks, mask=mask_k, other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += w * a[None, :]
        w_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K
    y = tl.sum(acc, 1)
    if QUANT == 1:
        y *= tl.load(s_base)
    if QUANT == 2:
        y *= tl.load(s_base + offs_n * stride_sn, mask=mask_n, other=0.0)
    if MUL_WEIGHT:
        y *= tl.load(tw_ptr + token * stride_tm + slot * stride_tk).to(tl.float32)
    y = tl.where(routed, y, 0.0)  # whatever the slot's weight and expert 0's scales are
    if MODE == 0:
        tl.store(out_ptr + token * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)
    elif MODE == 1:
        tl.atomic_add(out_ptr + token * stride_om + offs_n, y.to(out_ptr.dtype.element_ty),
                      mask=offs_n < tl.where(routed, H, 0), sem="relaxed")
    else:
        row = pair * SPLIT_K + pid_k
        tl.store(out_ptr + row * stride_om + offs_n, y, mask=mask_n)


@triton.jit
def _prefetch_l2(ptrs, nbytes):
    """Have the TMA unit bring ``nbytes`` from each of ``ptrs`` (16-byte aligned) into L2,
    without registers or a wait."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                              "=r,l,r", [ptrs, tl.zeros(ptrs.shape, dtype=tl.int32) + nbytes],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _reduce_rows(part_ptr, out_ptr, H, stride_pm, stride_om,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum of part[t * ROWS + r] for r = 0 .. ROWS - 1, in that order."""
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in range(ROWS):
        acc += tl.load(part_ptr + (token * ROWS + r) * stride_pm + offs, mask=mask, other=0.0)
    tl.store(out_ptr + token * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


REDUCE_BLOCK = 1024


def launcher(problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
    """The prepared call: both launches bound to ``weights`` and ``params`` (``moetune_decode``'s
    parameter names), and the reduce ``params["REDUCE"]`` picks where there is one."""
    hidden, inter = weights.w2.shape[1], weights.w2.shape[2]
    quant = CODES[problem.quant]
    w13, w2 = weights.w13, weights.w2
    s13, s13_strides = scale_args(weights.w13_scale, w13, quant)
    s2, s2_strides = scale_args(weights.w2_scale, w2, quant)
    bn1, bk1 = params["g1_BLOCK_N"], params["g1_BLOCK_K"]
    bn2, bk2 = params["g2_BLOCK_N"], params["g2_BLOCK_K"]
    split, reduce = params["SPLIT_K"], params["REDUCE"]
    tiles1, tiles2 = triton.cdiv(inter, bn1), triton.cdiv(hidden, bn2)
    k_per_split = triton.cdiv(triton.cdiv(inter, bk2), split) * bk2
    zero_block = triton.next_power_of_2(triton.cdiv(hidden, tiles1))
    act = act_code(problem)
    on_input = problem.router_weight_on_input
    launch1 = {"num_warps": params["g1_num_warps"], "num_stages": params["g1_num_stages"]}
    pdl = params["PDL"]
    launch2 = {"num_warps": params["g2_num_warps"], "num_stages": params["g2_num_stages"],
               **({"launch_pdl": True} if pdl else {})}
    if problem.topk == 1 and split == 1:
        mode, buffer = STORE, "out"
    elif reduce == "ordered":
        mode, buffer = PARTIAL, "partial"
    elif reduce == "atomic_out" or problem.dtype is DType.FLOAT32:
        mode, buffer = ATOMIC, "out"
    else:
        mode, buffer = ATOMIC, "float32"

    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        m, topk = topk_ids.shape
        pairs = m * topk
        x = x if x.stride(1) == 1 else x.contiguous()
        h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
        if out is None:
            out = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
        if buffer == "partial":
            target = torch.empty((pairs * split, hidden), dtype=torch.float32, device=x.device)
        elif buffer == "float32":
            target = torch.empty((m, hidden), dtype=torch.float32, device=x.device)
        else:
            target = out
        zero = mode == ATOMIC
        _gemm1_act[(pairs, tiles1)](
            x, w13, s13, topk_ids, topk_weights, h, target, hidden, inter, x.stride(0),
            *w13.stride(), *s13_strides, *topk_ids.stride(), *topk_weights.stride(), h.stride(0),
            target.stride(0), TOPK=topk, GATED=problem.gated, ACT=act, QUANT=quant,
            ON_INPUT=on_input, ZERO=zero, ZERO_BLOCK=zero_block, BLOCK_N=bn1, BLOCK_K=bk1,
            PDL=pdl, **launch1)
        _gemm2_reduce[(pairs, tiles2, split)](
            h, w2, s2, topk_ids, topk_weights, target, hidden, inter, k_per_split, h.stride(0),
            *w2.stride(), *s2_strides, *topk_ids.stride(), *topk_weights.stride(),
            target.stride(0), TOPK=topk, QUANT=quant, MUL_WEIGHT=not on_input, MODE=mode,
            SPLIT_K=split, BLOCK_N=bn2, BLOCK_K=bk2, PDL=pdl, **launch2)
        if buffer == "partial":
            _reduce_rows[(m, triton.cdiv(hidden, REDUCE_BLOCK))](
                target, out, hidden, target.stride(0), out.stride(0), ROWS=topk * split,
                BLOCK=REDUCE_BLOCK, num_warps=4)
        elif buffer == "float32":
            out.copy_(target)
        return out

    return run
