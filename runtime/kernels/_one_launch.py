"""The Triton kernel of ``moetune_decode_one``: a whole small-M MoE layer in one persistent launch.

A fixed grid of G programs. Work items are tiles, numbered pair-major (pair = token x TOPK + slot):
GEMM1 items (pair, I-tile), GEMM2 items (pair, H-tile). Program q takes the contiguous range
``[q N / G, (q + 1) N / G)`` of each kind (N items), so every program gets the same share within
one item, and runs in two phases:

1. GEMM1 items: gate and up rows of the pair's expert over H, float32, the router weight when
   it applies on the input, the activation and the gate product; the activated intermediate row
   piece is stored in float32 scratch ``h`` (pairs, I), then ``ready[pair]`` is incremented
   (release: the stores are visible before the count).
2. GEMM2 items: spin until ``ready[pair]`` reaches the pair's GEMM1 tile count (acquire), then
   the W2 rows of the H-tile over I against ``h``'s row, times the router weight. Top-1: the
   result is stored into ``out`` in its dtype. Top-k: the ordered reduce below.

A pair routed nowhere (``topk_ids`` -1: a padding row of a batch padded to a CUDA graph's size)
reads no weights and no activations: its GEMM1 items loop over nothing and store zeros (and
count into ``ready`` as any other), its GEMM2 items store a zero partial (or zeros into ``out``
at top-1) and arrive at the counters like any slot, so every count and reset is unchanged.

The reduce is ordered, not atomic: each pair stores its float32 partial (pairs, H); a counter
per (token, H-tile) counts the slots that arrived (acq_rel), and the last to arrive sums the
token's TOPK partials in slot order, casts to the output dtype and stores into ``out``. So the
result is the same bit for bit whatever the schedule (an eager call, a graph replay), no
accumulator needs zeroing before the next call, and no torch op follows the kernel. Float atomics
would read-modify-write the same L2 lines TOPK times and still need a final cast pass.

Counters reset within the call, so the next call (eager or a CUDA graph replay, which cannot
pass a new epoch number: its arguments are frozen at capture) starts from zeros without a host
sync: the last arriver of a (token, H-tile) sets its counter back to 0, and each program counts
itself into ``done`` when it has finished; the last (count G - 1) zeroes ``ready`` and ``done``.
Every wait on ``ready`` has ended by then. Stream order makes the zeros visible to the next
launch. Consequence: calls of one prepared callable must be stream-ordered (never concurrent).

Spin-waits need every program resident at once (a waiting program holds its SM slot; one not yet
started could never run). The launcher caps G at SMs x resident programs per SM of the compiled
kernel (registers, shared memory, threads). Sharing the GPU with an SM partition (MPS limits,
green contexts) would break that bound.

Under Triton's CPU interpreter programs run one after another, so a program must never wait on a
later one: the launcher then uses G = gcd(G, pairs), which makes each program own whole pairs in
both phases (it waits only on itself). The interpreter checks the math, the work split, the
counter arithmetic and the resets; it cannot check concurrency (memory ordering, residency).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import triton
import triton.language as tl

from moetune.runtime.kernels._act_triton import act_code
from moetune.runtime.kernels._decode import gemm1_tile
from moetune.runtime.kernels._scales import CODES, scale_args
from moetune.runtime.kernels.base import MoEFn, MoEWeights
from moetune.runtime.problem import MoEProblem

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: Routed pairs (num_tokens x topk) the kernel serves: the counters are sized for them.
MAX_PAIRS = 64


@triton.jit
def _one_launch(x_ptr, w1_ptr, s1_ptr, w2_ptr, s2_ptr, ids_ptr, tw_ptr, h_ptr, part_ptr, out_ptr,
                done_ptr, ready_ptr, arrived_ptr, H, I, M,
                stride_xm, stride_w1e, stride_w1n, stride_w1k, stride_s1e, stride_s1n, stride_s1k,
                stride_w2e, stride_w2n, stride_w2k, stride_s2e, stride_s2n, stride_s2k,
                stride_im, stride_ik, stride_tm, stride_tk, stride_om,
                TOPK: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr,
                ON_INPUT: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
                BN2: tl.constexpr, BK2: tl.constexpr, MAX_PAIRS: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    pairs = M * TOPK
    tiles1 = tl.cdiv(I, BN1)
    tiles2 = tl.cdiv(H, BN2)

    # --- phase 1: GEMM1 + activation into h ---------------------------------------------------
    n1 = pairs * tiles1
    for item in range(pid * n1 // programs, (pid + 1) * n1 // programs):
        pair = item // tiles1
        pid_n = item % tiles1
        token = pair // TOPK
        slot = pair % TOPK
        expert = tl.load(ids_ptr + token * stride_im + slot * stride_ik).to(tl.int64)
        h_end = tl.where(expert >= 0, H, 0)  # routed nowhere: no rows read, zeros stored
        expert = tl.maximum(expert, 0)
        act, offs_n = gemm1_tile(x_ptr, w1_ptr, s1_ptr, tw_ptr, token, slot, expert, h_end,
                                 pid_n, H, I, stride_xm, stride_w1e, stride_w1n, stride_w1k,
                                 stride_s1e, stride_s1n, stride_s1k, stride_tm, stride_tk,
                                 GATED, ACT, QUANT, ON_INPUT, BN1, BK1)
        mask_n = offs_n < I
        tl.store(h_ptr + pair * I + offs_n, act, mask=mask_n)
        tl.debug_barrier()  # every thread's stores precede the release below
        tl.atomic_add(ready_ptr + pair, 1, sem="release")

    # --- phase 2: GEMM2 x router weight, then the ordered top-k reduce -------------------------
    n2 = pairs * tiles2
    for item in range(pid * n2 // programs, (pid + 1) * n2 // programs):
        pair = item // tiles2
        pid_n = item % tiles2
        token = pair // TOPK
        slot = pair % TOPK
        expert = tl.load(ids_ptr + token * stride_im + slot * stride_ik).to(tl.int64)
        routed = expert >= 0
        i_end = tl.where(routed, I, 0)
        expert = tl.maximum(expert, 0)
        offs_n = pid_n * BN2 + tl.arange(0, BN2)
        mask_n = offs_n < H
        offs_k = tl.arange(0, BK2)
        w_ptrs = (w2_ptr + expert * stride_w2e + offs_n[:, None] * stride_w2n
                  + offs_k[None, :] * stride_w2k)
        a_ptrs = h_ptr + pair * I + offs_k
        s_base = s2_ptr + expert * stride_s2e
        row_block = (pid_n * BN2) // 128
        while tl.atomic_add(ready_ptr + pair, 0, sem="acquire") < tiles1:
            pass
        tl.debug_barrier()  # no thread reads h before the acquire
        acc = tl.zeros([BN2, BK2], dtype=tl.float32)
        for k in range(0, i_end, BK2):
            mask_k = offs_k < I - k
            a = tl.load(a_ptrs, mask=mask_k, other=0.0, cache_modifier=".cg")
            if QUANT == 3:
                col_blocks = ((k + offs_k) // 128) * stride_s2k
                a = a * tl.load(s_base + row_block * stride_s2n + col_blocks, mask=mask_k,
                                other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            acc += w * a[None, :]
            w_ptrs += BK2 * stride_w2k
            a_ptrs += BK2
        y = tl.sum(acc, 1)
        if QUANT == 1:
            y *= tl.load(s_base)
        if QUANT == 2:
            y *= tl.load(s_base + offs_n * stride_s2n, mask=mask_n, other=0.0)
        if not ON_INPUT:
            y *= tl.load(tw_ptr + token * stride_tm + slot * stride_tk).to(tl.float32)
        y = tl.where(routed, y, 0.0)  # whatever the slot's weight and expert 0's scales are
        if TOPK == 1:
            tl.store(out_ptr + token * stride_om + offs_n, y.to(out_ptr.dtype.element_ty),
                     mask=mask_n)
        else:
            tl.store(part_ptr + pair * H + offs_n, y, mask=mask_n)
            tl.debug_barrier()
            counter = arrived_ptr + token * tiles2 + pid_n
            if tl.atomic_add(counter, 1, sem="acq_rel") == TOPK - 1:  # the last slot here
                tl.debug_barrier()
                total = tl.zeros([BN2], dtype=tl.float32)
                for s in range(TOPK):
                    total += tl.load(part_ptr + (token * TOPK + s) * H + offs_n, mask=mask_n,
                                     other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + token * stride_om + offs_n,
                         total.to(out_ptr.dtype.element_ty), mask=mask_n)
                tl.atomic_xchg(counter, 0)

    # --- the last program to finish resets the pair counters for the next call -----------------
    tl.debug_barrier()
    if tl.atomic_add(done_ptr, 1, sem="acq_rel") == programs - 1:
        offs = tl.arange(0, MAX_PAIRS)
        tl.store(ready_ptr + offs, tl.zeros([MAX_PAIRS], dtype=tl.int32), mask=offs < pairs)
        tl.atomic_xchg(done_ptr, 0)


def grid_size(programs: int, pairs: int, items: int, interpreted: bool) -> int:
    """Programs to launch: ``programs`` (already capped at what can be resident), no more than
    the larger phase has items; under the interpreter a divisor of ``pairs`` (programs then own
    whole pairs and never wait on a later program)."""
    g = max(1, min(programs, items))
    return math.gcd(g, pairs) if interpreted else g


def resident_per_sm(compiled: Any, device: torch.device) -> int:
    """How many programs of ``compiled`` (a Triton ``CompiledKernel``) one SM holds at once:
    the least of the thread, register (allocated per warp in 256s) and shared-memory limits."""
    compiled._init_handles()  # loads the binary: sets n_regs
    props = torch.cuda.get_device_properties(device)
    threads = compiled.metadata.num_warps * 32
    regs = -(-max(compiled.n_regs, 1) // 8) * 8
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs * threads)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 << 10)
    by_smem = smem // (compiled.metadata.shared + 1024)  # 1 KiB per block is reserved
    return max(1, min(32, by_threads, by_regs, by_smem))


def launcher(problem: MoEProblem, params: dict[str, Any], weights: MoEWeights,
             sm_count: int) -> MoEFn:
    """The prepared call bound to ``weights`` and ``params`` (``moetune_decode_one``'s names),
    with ``PROGRAMS_PER_SM x sm_count`` programs at most, fewer where the compiled kernel cannot
    keep that many resident. Owns the counters: calls must be stream-ordered."""
    hidden, inter = weights.w2.shape[1], weights.w2.shape[2]
    quant = CODES[problem.quant]
    w13, w2 = weights.w13, weights.w2
    s13, s13_strides = scale_args(weights.w13_scale, w13, quant)
    s2, s2_strides = scale_args(weights.w2_scale, w2, quant)
    bn1, bn2 = params["BLOCK_N1"], params["BLOCK_N2"]
    tiles1, tiles2 = triton.cdiv(inter, bn1), triton.cdiv(hidden, bn2)
    # done (1) | ready (MAX_PAIRS) | arrived (tokens x H-tiles): zero now, zero after each call.
    counters = torch.zeros(1 + MAX_PAIRS + MAX_PAIRS * tiles2, dtype=torch.int32,
                           device=w13.device)
    done, ready, arrived = counters[:1], counters[1:1 + MAX_PAIRS], counters[1 + MAX_PAIRS:]
    constexprs = {"TOPK": problem.topk, "GATED": problem.gated, "ACT": act_code(problem),
                  "QUANT": quant, "ON_INPUT": problem.router_weight_on_input,
                  "BN1": bn1, "BK1": params["BLOCK_K1"], "BN2": bn2, "BK2": params["BLOCK_K2"],
                  "MAX_PAIRS": MAX_PAIRS, "num_warps": params["num_warps"],
                  "num_stages": params["num_stages"]}
    capacity: list[int] = []  # programs that can be resident, known once compiled

    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        m, topk = topk_ids.shape
        pairs = m * topk
        if pairs > MAX_PAIRS:
            raise ValueError(f"moetune_decode_one serves at most {MAX_PAIRS} routed pairs, "
                             f"got {m} x {topk}")
        x = x if x.stride(1) == 1 else x.contiguous()
        if out is None:
            out = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
        h = torch.empty((pairs, inter), dtype=torch.float32, device=x.device)
        part = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device) \
            if topk > 1 else h
        args = (x, w13, s13, w2, s2, topk_ids, topk_weights, h, part, out, done, ready, arrived,
                hidden, inter, m, x.stride(0), *w13.stride(), *s13_strides, *w2.stride(),
                *s2_strides, *topk_ids.stride(), *topk_weights.stride(), out.stride(0))
        if not capacity:
            per_sm = params["PROGRAMS_PER_SM"]
            if not INTERPRET:
                compiled = _one_launch.warmup(*args, grid=(1,), **constexprs)
                per_sm = min(per_sm, resident_per_sm(compiled, x.device))
            capacity.append(per_sm * sm_count)
        grid = grid_size(capacity[0], pairs, pairs * max(tiles1, tiles2), INTERPRET)
        _one_launch[(grid,)](*args, **constexprs)
        return out

    return run
