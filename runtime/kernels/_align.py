"""Sort routed (token, slot) pairs by expert into ``BLOCK_SIZE_M``-padded blocks: the layout of
vLLM's ``moe_align_block_size`` that aiter's Triton MoE GEMMs read.

aiter's own Triton align crashes on CUDA. This one is three tiny kernels with no host sync, so it
runs inside CUDA graphs: count the pairs per expert, lay the blocks out (one program per chunk of
blocks: a single program labelling them all took 20 us of a 1.1 ms DeepSeek-V3 layer at 4096
tokens on an H200), and scatter each pair to its slot. Within an expert the order comes from
atomics and may vary between calls; results do not, since every GEMM row is computed on its own.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

_CHUNK = 1024


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
def _count_kernel(ids_ptr, counts_ptr, numel, CHUNK: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < numel
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    tl.atomic_add(counts_ptr + ids, 1, mask=mask)


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
    b = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    expert = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), 1)
    tl.store(expert_ids_ptr + b, tl.minimum(expert, num_experts - 1), mask=b < num_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, numel, CHUNK: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < numel
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    dest = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
    tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=mask)


def padded_length(numel: int, block_m: int, num_experts: int) -> int:
    """Upper bound of the padded length (vLLM's): every expert may waste ``block_m - 1`` slots,
    but no more experts than routed pairs can be hit."""
    length = numel + num_experts * (block_m - 1)
    return min(numel * block_m, length) if numel < num_experts else length


def align(topk_ids: torch.Tensor, block_m: int, num_experts: int, length: int | None = None) -> Routing:
    """Routing of ``topk_ids`` (M, topk) for ``block_m``-row tiles; ``length`` overrides the
    buffer length (at least ``padded_length``), e.g. to bound recompiles of kernels keyed on it."""
    numel = topk_ids.numel()
    length = length or padded_length(numel, block_m, num_experts)
    num_blocks = triton.cdiv(length, block_m)
    ids = topk_ids.reshape(-1)
    dev = topk_ids.device
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    sorted_ids = torch.full((length,), numel, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(numel, _CHUNK),)
    _count_kernel[grid](ids, counts, numel, CHUNK=_CHUNK)
    e_pow2 = triton.next_power_of_2(num_experts)
    chunk = max(1, 8192 // e_pow2)
    _layout_kernel[(triton.cdiv(num_blocks, chunk),)](
        counts, cursor, expert_ids, num_post, num_experts, num_blocks, BLOCK_M=block_m,
        E_POW2=e_pow2, CHUNK=chunk)
    _scatter_kernel[grid](ids, cursor, sorted_ids, numel, CHUNK=_CHUNK)
    return Routing(sorted_ids, expert_ids, num_post)
