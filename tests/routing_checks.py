"""What every aligned routing must satisfy, on any device and either align path."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the align module needs triton, which a CPU-only install may lack
    from moetune.runtime.kernels._align import Routing


def random_ids(m: int, topk: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """(m, topk) distinct experts per token, as a router picks them."""
    return torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(m)]).int()


def check_routing(ids: torch.Tensor, block: int, experts: int, r: Routing) -> None:
    """Every routed pair appears once, in a block of its expert; padding (and the tail past the
    used length) holds the out-of-range id; the used length is a whole number of blocks."""
    from moetune.runtime.kernels._align import padded_length

    flat = ids.view(-1).cpu()
    sorted_ids, expert_ids = r.sorted_token_ids.cpu(), r.expert_ids.cpu()
    n = int(r.num_tokens_post_padded)
    assert n % block == 0 and len(sorted_ids) == padded_length(flat.numel(), block, experts) >= n
    assert (sorted_ids[n:] == flat.numel()).all()
    valid = sorted_ids[:n][sorted_ids[:n] < flat.numel()]
    assert sorted(valid.tolist()) == list(range(flat.numel()))
    for b in range(n // block):
        rows = sorted_ids[b * block:(b + 1) * block]
        rows = rows[rows < flat.numel()].long()
        assert len(rows) and (flat[rows] == expert_ids[b]).all()
