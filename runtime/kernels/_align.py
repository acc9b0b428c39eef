"""Sort routed (token, slot) pairs by expert into ``BLOCK_SIZE_M``-padded blocks: the layout of
vLLM's ``moe_align_block_size`` that aiter's Triton MoE GEMMs read.

aiter's own Triton align crashes on CUDA. This one needs no host sync, so it runs inside CUDA
graphs. Up to ``ONE_PROGRAM_MAX`` routed pairs it is one launch: a single program counts the
pairs per expert, lays the blocks out, fills the padding and scatters every pair to its slot
(at decode sizes each launch costs more than its work). Past that, the work spreads over
programs in three launches and two fills: count (one histogram per chunk of pairs, then one
atomic per expert), lay the blocks out (one program per chunk of blocks: a single program
labelling them all took 20 us of a 1.1 ms DeepSeek-V3 layer at 4096 tokens on an H200), and
scatter. Within an expert the order comes from atomics and may vary between calls; results do
not, since every GEMM row is computed on its own.

A pair routed nowhere (``topk_ids`` -1: a padding row of a batch padded to a CUDA graph's size)
is in no expert's group: no block holds it, so no GEMM reads it.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

_CHUNK = 1024
#: Elements of the (chunk of blocks, experts) comparison that labels blocks with their expert.
_LABEL_WORK = 8192
#: Routed pairs up to which one program does the whole align. On the H200 one launch took
#: 3.8-4.6 us against 8.5-9.0 us for three at 8-64 pairs, broke even at 512-1024 pairs with 256
#: experts (1.25-1.37x faster with 128) and lost from 2048 (``bench/results/launches-h200-*``).
ONE_PROGRAM_MAX = 1024


@dataclasses.dataclass(frozen=True)
class Routing:
    """``sorted_token_ids``: flat (token * topk + slot) ids grouped by expert, each group padded to
    a multiple of ``block_m`` with the number of routed pairs (an id past the end, which the GEMMs
    mask); ``expert_ids``: the expert of each block; ``num_tokens_post_padded``: (1,) the padded
    length actually used."""

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor


@triton.jit
def _chunk_counts(ids_ptr, start, numel, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs per expert among the ``CHUNK`` pairs from ``start``, counted in registers; a pair
    routed nowhere (id -1) counts in no expert."""
    offs = start + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
    routed = ids >= 0
    # Lanes past the end and unrouted pairs count as expert 0; take them back out of its bin.
    missing = tl.sum((~routed).to(tl.int32), 0)
    return (tl.histogram(tl.where(routed, ids, 0), E_POW2)
            - tl.where(tl.arange(0, E_POW2) == 0, missing, 0))


@triton.jit
def _labels(block_end, first, num_experts, num_blocks, expert_ids_ptr, CHUNK: tl.constexpr):
    """Label blocks ``first``.. (``CHUNK`` of them) with their expert: the number of experts
    whose blocks end at or before each (``block_end``: the inclusive prefix sum of blocks)."""
    b = first + tl.arange(0, CHUNK)
    expert = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), 1)
    tl.store(expert_ids_ptr + b, tl.minimum(expert, num_experts - 1), mask=b < num_blocks)


@triton.jit
def _scatter(ids_ptr, cursor_ptr, sorted_ptr, start, numel, CHUNK: tl.constexpr):
    """Each of the ``CHUNK`` pairs from ``start`` to the next free slot of its expert (a pair
    routed nowhere goes nowhere)."""
    offs = start + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
    mask = ids >= 0
    dest = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
    tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=mask)


@triton.jit
def _one_program_kernel(ids_ptr, cursor_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, numel,
                        length, num_experts, num_blocks, BLOCK_M: tl.constexpr,
                        E_POW2: tl.constexpr, CHUNK: tl.constexpr, LABEL_CHUNK: tl.constexpr):
    e = tl.arange(0, E_POW2)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for start in range(0, numel, CHUNK):
        counts += _chunk_counts(ids_ptr, start, numel, E_POW2, CHUNK)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    tl.store(cursor_ptr + e, (block_end - blocks) * BLOCK_M, mask=e < num_experts)
    tl.store(num_post_ptr, tl.sum(blocks, 0) * BLOCK_M)
    for first in range(0, num_blocks, LABEL_CHUNK):
        _labels(block_end, first, num_experts, num_blocks, expert_ids_ptr, LABEL_CHUNK)
    for start in range(0, length, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + numel, mask=offs < length)
    tl.debug_barrier()  # every thread's cursors and padding are written before any scatter
    for start in range(0, numel, CHUNK):
        _scatter(ids_ptr, cursor_ptr, sorted_ptr, start, numel, CHUNK)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, numel, num_experts, E_POW2: tl.constexpr,
                  CHUNK: tl.constexpr):
    e = tl.arange(0, E_POW2)
    counts = _chunk_counts(ids_ptr, tl.program_id(0) * CHUNK, numel, E_POW2, CHUNK)
    tl.atomic_add(counts_ptr + e, counts, mask=(e < num_experts) & (counts > 0))


@triton.jit
def _layout_kernel(counts_ptr, cursor_ptr, expert_ids_ptr, num_post_ptr, num_experts, num_blocks,
                   BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """Each program labels ``CHUNK`` blocks with their expert (every program redoes the cheap
    prefix sum over experts, so the labels need no second pass); program 0 also writes the
    experts' first slots and the padded length."""
    e = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    if tl.program_id(0) == 0:
        tl.store(cursor_ptr + e, (block_end - blocks) * BLOCK_M, mask=e < num_experts)
        tl.store(num_post_ptr, tl.sum(blocks, 0) * BLOCK_M)
    _labels(block_end, tl.program_id(0) * CHUNK, num_experts, num_blocks, expert_ids_ptr, CHUNK)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, numel, CHUNK: tl.constexpr):
    _scatter(ids_ptr, cursor_ptr, sorted_ptr, tl.program_id(0) * CHUNK, numel, CHUNK)


def padded_length(numel: int, block_m: int, num_experts: int) -> int:
    """Upper bound of the padded length (vLLM's): every expert may waste ``block_m - 1`` slots,
    but no more experts than routed pairs can be hit."""
    length = numel + num_experts * (block_m - 1)
    return min(numel * block_m, length) if numel < num_experts else length


def align(topk_ids: torch.Tensor, block_m: int, num_experts: int, length: int | None = None,
          one_program_max: int = ONE_PROGRAM_MAX) -> Routing:
    """Routing of ``topk_ids`` (M, topk) for ``block_m``-row tiles; ``length`` overrides the
    buffer length (at least ``padded_length``), e.g. to bound recompiles of kernels keyed on it;
    ``one_program_max``: the most routed pairs aligned in one launch (benchmarks move it)."""
    numel = topk_ids.numel()
    length = length or padded_length(numel, block_m, num_experts)
    num_blocks = triton.cdiv(length, block_m)
    ids = topk_ids.reshape(-1)
    dev = topk_ids.device
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    e_pow2 = triton.next_power_of_2(num_experts)
    label_chunk = max(1, _LABEL_WORK // e_pow2)
    if numel <= one_program_max:
        sorted_ids = torch.empty(length, dtype=torch.int32, device=dev)
        _one_program_kernel[(1,)](
            ids, cursor, sorted_ids, expert_ids, num_post, numel, length, num_experts, num_blocks,
            BLOCK_M=block_m, E_POW2=e_pow2, CHUNK=_CHUNK, LABEL_CHUNK=label_chunk)
        return Routing(sorted_ids, expert_ids, num_post)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    sorted_ids = torch.full((length,), numel, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(numel, _CHUNK),)
    _count_kernel[grid](ids, counts, numel, num_experts, E_POW2=e_pow2, CHUNK=_CHUNK)
    _layout_kernel[(triton.cdiv(num_blocks, label_chunk),)](
        counts, cursor, expert_ids, num_post, num_experts, num_blocks, BLOCK_M=block_m,
        E_POW2=e_pow2, CHUNK=label_chunk)
    _scatter_kernel[grid](ids, cursor, sorted_ids, numel, CHUNK=_CHUNK)
    return Routing(sorted_ids, expert_ids, num_post)
