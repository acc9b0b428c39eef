"""The Triton kernels of ``moetune_grouped``: a prefill MoE layer as two grouped GEMMs over routed
pairs sorted by expert (``_align``), with no (M * topk, H) intermediate and no separate sum.

1. ``_gemm1_act``: one program per (block of sorted pairs, tile of I). The gate and up tiles of
   the block's expert are read once per K step and multiplied by the same activation tile (two
   accumulators, or with ``PAIR_TMA`` one TMA box and one dot for both, split after the loop:
   ``_gate_up_pairs``); the epilogue applies the scales, the router weight when it is on the input,
   the activation and the gate product, and writes the activated intermediate (pairs, I).
   Where GEMM2 adds into its output, every GEMM1 program also zeroes a share of that output
   first (``ZERO``), so no fill launch precedes GEMM2; where GEMM2 stores a row per routed
   pair, only the rows of pairs routed nowhere (``topk_ids`` -1, which ``_align`` puts in no
   block, so GEMM2 never reaches them) get zeros.
2. ``_gemm2_reduce``: one program per (block of sorted pairs, ``N_TILES`` tiles of H), the
   tiles in one loop over (tile, K step) so that loads stay in flight across tiles when I is
   short; with ``N_MAJOR`` the programs take every block of pairs for one group of columns
   before the next (so the output columns the reduce adds into stay in L2), else
   ``GROUP_M`` blocks at a time across all of H. The epilogue multiplies the router weight
   and adds each row into its token's output row (``ATOMIC``: into a float32 buffer or the
   output itself), stores it (``STORE``: top-1, nothing to reduce), or stores the (pairs, H)
   rows a torch sum then reduces (``ROWS``: what vLLM does, kept so the search measures the
   fused reduce against it on every GPU and shape).
   ``_gemm2_persistent`` runs the same tiles (``_gemm2_tile``) on a fixed grid of a few
   programs per SM, each walking units of ``N_TILES`` tiles in one flattened loop.

``W_TMA`` loads both GEMMs' weight tiles through TMA descriptors (made once per prepared call)
instead of pointers. GEMM1 gathers its activation rows by token; GEMM2's are gathered by routed
pair, or with ``A_TMA`` GEMM1 writes the intermediate in sorted order (a row per padded
position, so a block's rows are adjacent) and GEMM2 loads each tile through a descriptor.

fp8 layers run W8A8 on fp8 tensor cores: activations are quantized per token (per 128-column
group for block-fp8 weights) before each GEMM, GEMM2's in GEMM1's epilogue with ``FP8_OUT``
(block fp8, where a tile holds whole groups), and the epilogue applies the activation and
weight scales (per expert, per output row, or per 128x128 block, where a K step lies inside one
block column and each output column reads its row block's scale).

``INTERPRET`` records whether Triton's CPU interpreter was on when these kernels were defined.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from moetune.runtime.kernels._act_triton import act_code, gated_act
from moetune.runtime.kernels._align import align
from moetune.runtime.kernels._scales import CODES, QUANT_BLOCK, QUANT_NONE, SCALE_BLOCK, scale_args
from moetune.runtime.kernels.base import MoEFn, MoEWeights
from moetune.runtime.kernels.triton_config import compute_units, config_of
from moetune.runtime.problem import DType, MoEProblem

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: What ``_gemm2_reduce`` does with a row of its tile.
STORE, ATOMIC, ROWS = 0, 1, 2


@triton.jit
def _tile(pid, num_rows, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          GROUP_M: tl.constexpr):
    """The (row block, column tile) of program ``pid``, ``GROUP_M`` row blocks at a time so that
    programs running together share weight tiles in L2."""
    num_m = tl.cdiv(num_rows, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    return pid_m, pid_n


@triton.jit
def _weight_tile(w_desc, w_ptrs, expert, first_n, first_k, mask, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, W_TMA: tl.constexpr):
    """The (BLOCK_K, BLOCK_N) tile of ``expert``'s weight rows ``first_n``.. at columns
    ``first_k``..: by the TMA unit through descriptor ``w_desc`` (rows of the (E, N, K) weight,
    zero past its edges), or by pointers ``w_ptrs`` under ``mask``."""
    if W_TMA:
        tile = w_desc.load([expert.to(tl.int32), first_n, first_k])
        return tile.reshape(BLOCK_N, BLOCK_K).T
    else:
        return tl.load(w_ptrs, mask=mask, other=0.0)


@triton.jit
def _block_scaled(acc, a, w, a_scale, s_ptr, first_n, offs_n, mask_n, stride_sn,
                  ONE_BLOCK: tl.constexpr):
    """``acc`` plus one K step's ``a @ w`` under block-fp8 scales: the activation's per row
    (``a_scale``) and the weight's per 128x128 block (``s_ptr``: the step's block column).
    ``ONE_BLOCK``: the tile's columns ``first_n``.. lie in one 128-row block, so its weight
    scale is one number and the step costs one multiply-add per element, not two multiplies and
    an add with a vector load of scales."""
    if ONE_BLOCK:
        scale = a_scale * tl.load(s_ptr + (first_n // 128) * stride_sn)
        return acc + tl.dot(a, w) * scale[:, None]
    else:
        w_scale = tl.load(s_ptr + (offs_n // 128) * stride_sn, mask=mask_n, other=0.0)
        return acc + tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]


@triton.jit
def _k_step(acc, a, a_scale, w_desc, w_ptrs, s_step, expert, first_n, first_k, offs_n, mask_n,
            mask_k, stride_sn, QUANT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            W_TMA: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """``acc`` plus one K step: the weight tile of columns ``first_n``.. at ``first_k``.. times
    the activation tile ``a``, under block scales (``s_step``: the step's block column) or
    plain."""
    w = _weight_tile(w_desc, w_ptrs, expert, first_n, first_k, mask_k[:, None] & mask_n[None, :],
                     BLOCK_N, BLOCK_K, W_TMA)
    if QUANT == 3:
        return _block_scaled(acc, a, w, a_scale, s_step, first_n, offs_n, mask_n, stride_sn,
                             ONE_BLOCK)
    else:
        return tl.dot(a, w, acc)


@triton.jit
def _step_scales(xs_ptr, row_offset, valid, s_base, stride_sk, first_k, QUANT: tl.constexpr):
    """Block-fp8's scales of the K step at ``first_k`` (inside one 128-column block): the
    activation rows' (at ``row_offset`` of ``xs_ptr``) and the pointer to the weight's block
    column; other schemes apply their scales after the loop, and these go unread."""
    if QUANT == 3:
        group = first_k // 128
        return (tl.load(xs_ptr + row_offset + group, mask=valid, other=0.0),
                s_base + group * stride_sk)
    else:
        return 0.0, s_base


@triton.jit
def _zero_share(ptr, rows, cols, stride, BLOCK: tl.constexpr):
    """This program's rows of the (rows, cols) matrix at ``ptr`` (row stride ``stride``) set to
    zero: row r falls to program r mod the grid. A division per element instead made the layer
    slower than a separate fill where the output is large (0.977x at Qwen3-235B, 4096 tokens,
    on an H200: ``bench/results/launches-h200-2026-12-02``)."""
    zeros = tl.zeros([BLOCK], dtype=ptr.dtype.element_ty)
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        base = ptr + (tl.zeros([1], dtype=tl.int64) + row) * stride
        for first in range(0, cols, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            tl.store(base + offs, zeros, mask=offs < cols)


@triton.jit
def _zero_unrouted(ptr, ids_ptr, rows, cols, stride, BLOCK: tl.constexpr):
    """``_zero_share``'s rows of the (rows, cols) matrix at ``ptr`` whose routed pair (the same
    row of the flat ``topk_ids``) goes nowhere: GEMM2 never reaches them, and the torch sum or
    the output reads them."""
    zeros = tl.zeros([BLOCK], dtype=ptr.dtype.element_ty)
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        if tl.load(ids_ptr + row) < 0:
            base = ptr + (tl.zeros([1], dtype=tl.int64) + row) * stride
            for first in range(0, cols, BLOCK):
                offs = first + tl.arange(0, BLOCK)
                tl.store(base + offs, zeros, mask=offs < cols)


@triton.jit
def _gate_up_pairs(a_ptrs, valid, offs_k, w_desc, expert, pid_n, H, I, xs_ptr, xs_offset, s_base,
                   stride_sn, stride_sk, QUANT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """GEMM1's gate and up accumulators from one TMA load and one ``tl.dot`` per K step: the
    descriptor views the (E, 2I, K) weight as (E, 2, I, K), so a (1, 2, BLOCK_N, BLOCK_K) box
    holds the gate rows and the matching up rows (zeros past I), and the (BLOCK_M, 2 * BLOCK_N)
    product splits into the two halves once, after the loop. Under block-fp8 scales each half
    lies in one 128-row block (``one_block``), so a step scales the product's gate columns by
    one number and its up columns by another, times each row's activation scale."""
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    # Column c of the product belongs to the gate half (c < BLOCK_N) or the up half.
    up_half = tl.arange(0, 2 * BLOCK_N) >= BLOCK_N
    gate_block = s_base + (pid_n * BLOCK_N // 128) * stride_sn
    up_block = s_base + ((I + pid_n * BLOCK_N) // 128) * stride_sn
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        mask_k = offs_k < H - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w = w_desc.load([expert.to(tl.int32), 0, pid_n * BLOCK_N, k * BLOCK_K])
        w = w.reshape(2 * BLOCK_N, BLOCK_K).T
        if QUANT == 3:  # a K step lies inside one 128-column block
            group = k * BLOCK_K // 128
            a_scale = tl.load(xs_ptr + xs_offset + group, mask=valid, other=0.0)
            gate_scale = a_scale * tl.load(gate_block + group * stride_sk)
            up_scale = a_scale * tl.load(up_block + group * stride_sk)
            acc += tl.dot(a, w) * tl.where(up_half[None, :], up_scale[:, None],
                                           gate_scale[:, None])
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
    return acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1).split()


@triton.jit
def _gemm1_act(x_ptr, xs_ptr, w_ptr, w_desc, s_ptr, tw_ptr, h_ptr, hs_ptr, sorted_ptr,
               experts_ptr, post_ptr, ids_ptr, zero_ptr, zero_rows, zero_cols, zero_stride, H, I, pairs,
               num_rows, stride_xm, stride_xsm, stride_we, stride_wn, stride_wk, stride_se,
               stride_sn, stride_sk, stride_hm, stride_hsm,
               TOPK: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr,
               ON_INPUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, W_TMA: tl.constexpr,
               ZERO: tl.constexpr, ONE_BLOCK: tl.constexpr, PAIR_TMA: tl.constexpr,
               SORTED: tl.constexpr, FP8_OUT: tl.constexpr, FP8_MAX: tl.constexpr):
    if ZERO == 1:  # GEMM2 adds into this buffer
        _zero_share(zero_ptr, zero_rows, zero_cols, zero_stride, 1024)
    if ZERO == 2:  # GEMM2 stores a row per routed pair: those routed nowhere get zeros here
        _zero_unrouted(zero_ptr, ids_ptr, zero_rows, zero_cols, zero_stride, 1024)
    pid_m, pid_n = _tile(tl.program_id(0), num_rows, I, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(post_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    valid = pair < pairs
    token = (pair // TOPK).to(tl.int64)
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    s_base = s_ptr + expert * stride_se
    if PAIR_TMA:
        acc_gate, acc_up = _gate_up_pairs(a_ptrs, valid, offs_k, w_desc, expert, pid_n, H, I,
                                          xs_ptr, token * stride_xsm, s_base, stride_sn,
                                          stride_sk, QUANT, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        gate_ptrs = (w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
                     + offs_k[:, None] * stride_wk)
        up_ptrs = gate_ptrs + I * stride_wn
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            mask_k = offs_k < H - k * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
            a_scale, s_step = _step_scales(xs_ptr, token * stride_xsm, valid, s_base, stride_sk,
                                           k * BLOCK_K, QUANT)
            acc_gate = _k_step(acc_gate, a, a_scale, w_desc, gate_ptrs, s_step, expert,
                               pid_n * BLOCK_N, k * BLOCK_K, offs_n, mask_n, mask_k, stride_sn,
                               QUANT, BLOCK_N, BLOCK_K, W_TMA, ONE_BLOCK)
            if GATED:
                acc_up = _k_step(acc_up, a, a_scale, w_desc, up_ptrs, s_step, expert,
                                 I + pid_n * BLOCK_N, k * BLOCK_K, I + offs_n, mask_n, mask_k,
                                 stride_sn, QUANT, BLOCK_N, BLOCK_K, W_TMA, ONE_BLOCK)
            a_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K * stride_wk
            up_ptrs += BLOCK_K * stride_wk
    if QUANT == 1 or QUANT == 2:  # per-token activation scales
        row_scale = tl.load(xs_ptr + token * stride_xsm, mask=valid, other=0.0)
        acc_gate *= row_scale[:, None]
        acc_up *= row_scale[:, None]
    if QUANT == 1:
        acc_gate *= tl.load(s_base)
        acc_up *= tl.load(s_base)
    if QUANT == 2:
        acc_gate *= tl.load(s_base + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(s_base + (I + offs_n) * stride_sn, mask=mask_n, other=0.0)[None, :]
    if ON_INPUT:  # (w * x) @ W == w * (x @ W): the weight scales the GEMM's output instead
        weight = tl.load(tw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc_gate *= weight[:, None]
        acc_up *= weight[:, None]
    act = gated_act(acc_gate, acc_up, ACT, GATED)
    # Row of the intermediate: the block's own rows (``SORTED``: GEMM2 loads them as one box),
    # or the routed pair's.
    h_row = offs_m.to(tl.int64) if SORTED else pair.to(tl.int64)
    h_ptrs = h_ptr + h_row[:, None] * stride_hm + offs_n[None, :]
    if FP8_OUT:
        act, scale = _fp8_groups(act, BLOCK_M, BLOCK_N, FP8_MAX)
        group = pid_n * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
        tl.store(hs_ptr + h_row[:, None] * stride_hsm + group[None, :], scale,
                 mask=valid[:, None] & (group < I // 128)[None, :])
    tl.store(h_ptrs, act.to(h_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _fp8_groups(act, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8_MAX: tl.constexpr):
    """``act`` (BLOCK_M, BLOCK_N) in fp8's range with one float32 scale per row per 128
    columns, as ``_act_quant`` computes them (amax over 448, never below a tiny floor): GEMM2's
    block-fp8 input made in GEMM1's epilogue, so no bf16 intermediate is written and re-read."""
    groups = act.reshape(BLOCK_M, BLOCK_N // 128, 128)
    scale = tl.maximum(tl.max(tl.abs(groups), 2), 1e-12) / FP8_MAX
    q = tl.clamp(groups / scale[:, :, None], -FP8_MAX, FP8_MAX)
    return q.reshape(BLOCK_M, BLOCK_N), scale


@triton.jit
def _gemm2_reduce(a_ptr, a_desc, as_ptr, w_ptr, w_desc, s_ptr, tw_ptr, out_ptr, sorted_ptr,
                  experts_ptr, post_ptr, H, I, pairs, num_rows, stride_am, stride_asm, stride_we,
                  stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om,
                  TOPK: tl.constexpr, QUANT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                  MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, N_TILES: tl.constexpr,
                  N_MAJOR: tl.constexpr, W_TMA: tl.constexpr, ONE_BLOCK: tl.constexpr,
                  A_TMA: tl.constexpr):
    if N_MAJOR:  # every used row block for one group of columns, then the next group
        used_m = tl.cdiv(tl.load(post_ptr), BLOCK_M)
        pid_m = tl.program_id(0) % used_m
        pid_n = tl.program_id(0) // used_m
        if pid_n >= tl.cdiv(H, BLOCK_N * N_TILES):
            return
    else:
        pid_m, pid_n = _tile(tl.program_id(0), num_rows, H, BLOCK_M, BLOCK_N * N_TILES, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(post_ptr):
            return
    if N_TILES == 1:
        _gemm2_tile(pid_m, pid_n, a_ptr, a_desc, as_ptr, w_ptr, w_desc, s_ptr, tw_ptr, out_ptr,
                    sorted_ptr, experts_ptr, H, I, pairs, stride_am, stride_asm, stride_we,
                    stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om, TOPK, QUANT,
                    MUL_WEIGHT, MODE, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, ONE_BLOCK, A_TMA)
    else:
        pair, valid, row, expert, s_base = _row_block(pid_m, sorted_ptr, experts_ptr, pairs,
                                                      s_ptr, stride_se, BLOCK_M, A_TMA)
        offs_k = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # N_TILES column tiles in one loop over (tile, K step), so the pipeline keeps loading
        # across tiles: with I = 192-256 a tile has only 2-3 K steps to hide its loads behind.
        k_steps = tl.cdiv(I, BLOCK_K)
        for step in range(0, N_TILES * k_steps):
            k = step % k_steps
            first_n = (pid_n * N_TILES + step // k_steps) * BLOCK_N
            offs_n = first_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < H
            mask_k = offs_k < I - k * BLOCK_K
            a_ptrs = a_ptr + row[:, None] * stride_am + (k * BLOCK_K + offs_k)[None, :]
            a = _a_tile(a_desc, a_ptrs, pid_m * BLOCK_M, k * BLOCK_K,
                        valid[:, None] & mask_k[None, :], A_TMA)
            a_scale, s_step = _step_scales(as_ptr, row * stride_asm, valid, s_base, stride_sk,
                                           k * BLOCK_K, QUANT)
            acc = _k_step(acc, a, a_scale, w_desc, w_base + offs_n[None, :] * stride_wn
                          + (k * BLOCK_K + offs_k)[:, None] * stride_wk, s_step, expert, first_n,
                          k * BLOCK_K, offs_n, mask_n, mask_k, stride_sn, QUANT, BLOCK_N,
                          BLOCK_K, W_TMA, ONE_BLOCK)
            if k == k_steps - 1:
                _gemm2_epilogue(acc, pair, valid, row, offs_n, mask_n, as_ptr, stride_asm,
                                s_base, stride_sn, tw_ptr, out_ptr, stride_om, TOPK, QUANT,
                                MUL_WEIGHT, MODE)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


@triton.jit
def _gemm2_persistent(a_ptr, a_desc, as_ptr, w_ptr, w_desc, s_ptr, tw_ptr, out_ptr, sorted_ptr,
                      experts_ptr, post_ptr, H, I, pairs, stride_am, stride_asm, stride_we,
                      stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om,
                      TOPK: tl.constexpr, QUANT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                      MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, N_TILES: tl.constexpr,
                      N_MAJOR: tl.constexpr, W_TMA: tl.constexpr, ONE_BLOCK: tl.constexpr,
                      A_TMA: tl.constexpr):
    """GEMM2 on a fixed grid: each program walks the work units ``pid``, ``pid + programs``, ...
    (a row block's ``N_TILES`` adjacent column tiles, in ``_gemm2_reduce``'s orders) of the used
    row blocks in one flattened loop over (unit, tile, K step), so it loads the next tile's
    operands while it reduces this one's; in ``_gemm2_reduce`` a tile of a short K (I =
    192-256: 2-3 steps) waits on its loads with nothing else to do."""
    used_m = tl.cdiv(tl.load(post_ptr), BLOCK_M)
    groups_n = tl.cdiv(H, BLOCK_N * N_TILES)
    for unit in tl.range(tl.program_id(0), used_m * groups_n, tl.num_programs(0), flatten=True):
        if N_MAJOR:
            pid_m = unit % used_m
            pid_g = unit // used_m
        else:
            pid_m, pid_g = _tile(unit, used_m * BLOCK_M, H, BLOCK_M, BLOCK_N * N_TILES, GROUP_M)
        for j in range(0, N_TILES):  # a tile past H loads nothing and stores nothing
            _gemm2_tile(pid_m, pid_g * N_TILES + j, a_ptr, a_desc, as_ptr, w_ptr, w_desc, s_ptr,
                        tw_ptr, out_ptr, sorted_ptr, experts_ptr, H, I, pairs, stride_am,
                        stride_asm, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
                        stride_sk, stride_om, TOPK, QUANT, MUL_WEIGHT, MODE, BLOCK_M, BLOCK_N,
                        BLOCK_K, W_TMA, ONE_BLOCK, A_TMA)


@triton.jit
def _gemm2_tile(pid_m, pid_n, a_ptr, a_desc, as_ptr, w_ptr, w_desc, s_ptr, tw_ptr, out_ptr,
                sorted_ptr, experts_ptr, H, I, pairs, stride_am, stride_asm, stride_we,
                stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om,
                TOPK: tl.constexpr, QUANT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, W_TMA: tl.constexpr, ONE_BLOCK: tl.constexpr,
                A_TMA: tl.constexpr):
    """One (row block ``pid_m``, column tile ``pid_n``) of GEMM2, its rows into the output."""
    pair, valid, row, expert, s_base = _row_block(pid_m, sorted_ptr, experts_ptr, pairs, s_ptr,
                                                  stride_se, BLOCK_M, A_TMA)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(I, BLOCK_K)):
        mask_k = offs_k < I - k * BLOCK_K
        a = _a_tile(a_desc, a_ptrs, pid_m * BLOCK_M, k * BLOCK_K,
                    valid[:, None] & mask_k[None, :], A_TMA)
        a_scale, s_step = _step_scales(as_ptr, row * stride_asm, valid, s_base, stride_sk,
                                       k * BLOCK_K, QUANT)
        acc = _k_step(acc, a, a_scale, w_desc, w_ptrs, s_step, expert, pid_n * BLOCK_N,
                      k * BLOCK_K, offs_n, mask_n, mask_k, stride_sn, QUANT, BLOCK_N, BLOCK_K,
                      W_TMA, ONE_BLOCK)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    _gemm2_epilogue(acc, pair, valid, row, offs_n, mask_n, as_ptr, stride_asm, s_base,
                    stride_sn, tw_ptr, out_ptr, stride_om, TOPK, QUANT, MUL_WEIGHT, MODE)


@triton.jit
def _row_block(pid_m, sorted_ptr, experts_ptr, pairs, s_ptr, stride_se, BLOCK_M: tl.constexpr,
               SORTED: tl.constexpr):
    """GEMM2's row block ``pid_m``: its routed pairs (sorted by expert; ``valid`` false on
    padding), their rows of the intermediate (the block's own rows where GEMM1 wrote them in
    sorted order, ``SORTED``; else the pairs'), its expert and that expert's weight scales."""
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs).to(tl.int64)
    row = offs.to(tl.int64) if SORTED else pair
    expert = tl.load(experts_ptr + pid_m).to(tl.int64)
    return pair, pair < pairs, row, expert, s_ptr + expert * stride_se


@triton.jit
def _a_tile(a_desc, a_ptrs, first_row, first_k, mask, A_TMA: tl.constexpr):
    """GEMM2's (BLOCK_M, BLOCK_K) activation tile: by the TMA unit through ``a_desc`` (the
    intermediate in sorted order: the block's rows are adjacent; zeros past I), or gathered by
    pointers ``a_ptrs`` under ``mask``."""
    if A_TMA:
        return a_desc.load([first_row, first_k])
    else:
        return tl.load(a_ptrs, mask=mask, other=0.0)


@triton.jit
def _gemm2_epilogue(acc, pair, valid, row, offs_n, mask_n, as_ptr, stride_asm, s_base,
                    stride_sn, tw_ptr, out_ptr, stride_om, TOPK: tl.constexpr,
                    QUANT: tl.constexpr, MUL_WEIGHT: tl.constexpr, MODE: tl.constexpr):
    """Scales (the activation's at intermediate row ``row``), the router weight, and the tile's
    rows into the output (``MODE``) by routed pair."""
    if QUANT == 1 or QUANT == 2:
        acc *= tl.load(as_ptr + row * stride_asm, mask=valid, other=0.0)[:, None]
    if QUANT == 1:
        acc *= tl.load(s_base)
    if QUANT == 2:
        acc *= tl.load(s_base + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(tw_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    mask = valid[:, None] & mask_n[None, :]
    if MODE == 2:  # one row per routed pair: a torch sum reduces them
        tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        out_ptrs = out_ptr + (pair // TOPK)[:, None] * stride_om + offs_n[None, :]
        if MODE == 0:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask, sem="relaxed")


def activation_descriptor(a: torch.Tensor, config: dict[str, int]) -> Any:
    """A TMA descriptor of GEMM2's (rows, I) intermediate in sorted order, loading
    (BLOCK_SIZE_M, BLOCK_SIZE_K) tiles: one per call, as the intermediate is made per call."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(a, list(a.shape), list(a.stride()),
                            [config["BLOCK_SIZE_M"], config["BLOCK_SIZE_K"]])


def weight_descriptor(w: torch.Tensor, config: dict[str, int], gate_up: bool = False) -> Any:
    """A TMA descriptor of the (E, N, K) weight ``w`` loading (1, BLOCK_SIZE_N, BLOCK_SIZE_K)
    tiles, or with ``gate_up`` of ``w`` viewed as (E, 2, N / 2, K) loading a gate tile and its
    up tile together (``_gate_up_pairs``); made once per prepared call, since the weights do
    not move."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block = [config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]]
    if gate_up:
        e, n, k = w.shape
        w = w.view(e, 2, n // 2, k)
        block = [2] + block
    return TensorDescriptor(w, list(w.shape), list(w.stride()), [1] + block)


def one_block(config: dict[str, int], offset: int) -> bool:
    """Whether every tile of ``config``'s columns, also shifted by ``offset`` (GEMM1's up rows
    start at I), lies inside one 128-row block of block-fp8 weight scales."""
    return SCALE_BLOCK % config["BLOCK_SIZE_N"] == 0 and offset % SCALE_BLOCK == 0


def launcher(problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
    """The prepared call (``moetune_grouped``'s parameter names): routing once per distinct
    BLOCK_SIZE_M, activation quantization for fp8, both GEMMs, and the reduce
    ``params["REDUCE"]`` picks (top-1 stores its rows directly)."""
    from moetune.runtime.kernels._act_quant import FP8, FP8_MAX, quantize_rows

    config1, config2 = config_of(params, "g1_"), config_of(params, "g2_")
    num_experts, hidden, inter = weights.w2.shape
    quant = CODES[problem.quant]
    w13, w2 = weights.w13, weights.w2
    s13, s13_strides = scale_args(weights.w13_scale, w13, quant)
    s2, s2_strides = scale_args(weights.w2_scale, w2, quant)
    group = SCALE_BLOCK if quant == QUANT_BLOCK else None
    act = act_code(problem)
    on_input = problem.router_weight_on_input
    reduce, n_tiles = params["REDUCE"], params["g2_N_TILES"]
    persistent, units = params["g2_PERSISTENT"], compute_units(w2.device)
    w_tma, gate_up, a_tma = params["W_TMA"], params["g1_PAIR_TMA"], params["g2_A_TMA"]
    fp8_out = params["g1_FP8_OUT"]
    one_block1 = quant == QUANT_BLOCK and one_block(config1, inter * problem.gated)
    one_block2 = quant == QUANT_BLOCK and one_block(config2, 0)
    d13 = weight_descriptor(w13, config1, gate_up) if w_tma else w13
    d2 = weight_descriptor(w2, config2) if w_tma else w2
    if problem.topk == 1:
        mode, buffer = STORE, "out"
    elif reduce == "sum":
        mode, buffer = ROWS, "rows"
    elif reduce == "atomic_out" or problem.dtype is DType.FLOAT32:
        mode, buffer = ATOMIC, "out"
    else:
        mode, buffer = ATOMIC, "float32"

    def quantize(a: torch.Tensor,
                 used: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if quant == QUANT_NONE:
            return a, a  # the scale pointer is never read
        return quantize_rows(a, group, used)

    def launch(kernel: Any, config: dict[str, int], rows: int, cols: int,
               n_tiles: int = 1) -> Any:
        block_m, block_n = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"] * n_tiles
        grid = (triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n),)
        return kernel[grid]

    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        m, topk = topk_ids.shape
        pairs = m * topk
        x = x if x.stride(1) == 1 else x.contiguous()
        weights_flat, ids = topk_weights.reshape(-1), topk_ids.reshape(-1)
        routing1 = align(ids, config1["BLOCK_SIZE_M"], num_experts)
        routing2 = (routing1 if config2["BLOCK_SIZE_M"] == config1["BLOCK_SIZE_M"]
                    else align(ids, config2["BLOCK_SIZE_M"], num_experts))
        if out is None:
            out = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
        xq, xs = quantize(x)
        rows1 = routing1.sorted_token_ids.numel()
        # In sorted order (``g2_A_TMA``) the intermediate has a row per padded position, and
        # only the first num_tokens_post_padded hold anything.
        h_rows = rows1 if a_tma else pairs
        h = torch.empty((h_rows, inter), dtype=FP8 if fp8_out else x.dtype, device=x.device)
        # GEMM1 writes the scales too (``g1_FP8_OUT``); else ``h`` stands in, never read.
        hs = (torch.empty((h_rows, inter // SCALE_BLOCK), dtype=torch.float32, device=x.device)
              if fp8_out else h)
        if buffer == "rows":
            target = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
        elif buffer == "float32":
            target = torch.empty((m, hidden), dtype=torch.float32, device=x.device)
        else:
            target = out
        # GEMM1 zeroes all of what GEMM2 adds into, or the rows of what it stores row by
        # routed pair (a row per pair, or per token at top-1) that it never reaches.
        zero, zero_rows = (1, m) if mode == ATOMIC else (2, pairs)
        launch(_gemm1_act, config1, rows1, inter)(
            xq, xs, w13, d13, s13, weights_flat, h, hs, routing1.sorted_token_ids,
            routing1.expert_ids, routing1.num_tokens_post_padded, ids, target, zero_rows, hidden,
            target.stride(0), hidden, inter, pairs, rows1, xq.stride(0), xs.stride(0),
            *w13.stride(), *s13_strides, h.stride(0), hs.stride(0),
            TOPK=topk, GATED=problem.gated, ACT=act, QUANT=quant, ON_INPUT=on_input,
            BLOCK_M=config1["BLOCK_SIZE_M"], BLOCK_N=config1["BLOCK_SIZE_N"],
            BLOCK_K=config1["BLOCK_SIZE_K"], GROUP_M=config1["GROUP_SIZE_M"], W_TMA=w_tma,
            ZERO=zero, ONE_BLOCK=one_block1, PAIR_TMA=gate_up, SORTED=a_tma,
            FP8_OUT=fp8_out, FP8_MAX=FP8_MAX, num_warps=config1["num_warps"],
            num_stages=config1["num_stages"])
        hq, hs = ((h, hs) if fp8_out
                  else quantize(h, routing1.num_tokens_post_padded if a_tma else None))
        rows2 = routing2.sorted_token_ids.numel()
        a2 = activation_descriptor(hq, config2) if a_tma else hq
        args2 = (hq, a2, hs, w2, d2, s2, weights_flat, target, routing2.sorted_token_ids,
                 routing2.expert_ids, routing2.num_tokens_post_padded, hidden, inter, pairs)
        strides2 = (hq.stride(0), hs.stride(0), *w2.stride(), *s2_strides, target.stride(0))
        consts2 = dict(TOPK=topk, QUANT=quant, MUL_WEIGHT=not on_input, MODE=mode,
                       BLOCK_M=config2["BLOCK_SIZE_M"], BLOCK_N=config2["BLOCK_SIZE_N"],
                       BLOCK_K=config2["BLOCK_SIZE_K"], GROUP_M=config2["GROUP_SIZE_M"],
                       N_MAJOR=params["g2_N_MAJOR"], W_TMA=w_tma, ONE_BLOCK=one_block2,
                       A_TMA=a_tma,
                       num_warps=config2["num_warps"], num_stages=config2["num_stages"])
        if persistent:
            units2 = triton.cdiv(rows2, config2["BLOCK_SIZE_M"]) * triton.cdiv(
                hidden, config2["BLOCK_SIZE_N"] * n_tiles)
            _gemm2_persistent[(min(units2, persistent * units),)](
                *args2, *strides2, N_TILES=n_tiles, **consts2)
        else:
            launch(_gemm2_reduce, config2, rows2, hidden, n_tiles)(
                *args2, rows2, *strides2, N_TILES=n_tiles, **consts2)
        if buffer == "rows":
            torch.sum(target.view(m, topk, hidden), dim=1, out=out)
        elif buffer == "float32":
            out.copy_(target)
        return out

    return run
