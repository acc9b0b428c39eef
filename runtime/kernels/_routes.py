"""Rows routed nowhere (``topk_ids`` -1), made routable for kernels that index experts by id.

vLLM's routers (0.32-0.34) give the padding rows of a padded batch (CUDA graphs pad every batch to a
captured size) expert id -1 and weight 0, and vLLM's kernels skip them. moetune's kernels index
weights by expert id, so such a slot goes to expert 0 with weight 0 instead: the same output for
every real row, one launch on CUDA (a captured decode step has one per MoE layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _routable_kernel(ids_ptr, weights_ptr, ids_out_ptr, weights_out_ptr, n,
                     BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    weights = tl.load(weights_ptr + offs, mask=mask, other=0.0)
    routed = ids >= 0
    tl.store(ids_out_ptr + offs, tl.where(routed, ids, 0), mask=mask)
    tl.store(weights_out_ptr + offs, tl.where(routed, weights, 0.0), mask=mask)


def routable(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) with every slot of id -1 sent to expert 0 at weight 0; new tensors (vLLM
    may read its own after the experts). Graph-safe: no host sync."""
    if not ids.is_cuda:
        unrouted = ids < 0
        return weights.masked_fill(unrouted, 0), ids.masked_fill(unrouted, 0)
    ids, weights = ids.contiguous(), weights.contiguous()
    ids_out, weights_out = torch.empty_like(ids), torch.empty_like(weights)
    n = ids.numel()
    _routable_kernel[(triton.cdiv(n, BLOCK),)](ids, weights, ids_out, weights_out, n,
                                               BLOCK=BLOCK)
    return weights_out, ids_out
