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
    """Every routed pair appears once, in a block of its expert (one routed nowhere, none); padding (and the tail past the
    used length) holds the out-of-range id; the used length is a whole number of blocks."""
    from moetune.runtime.kernels._align import padded_length

    flat = ids.view(-1).cpu()
    sorted_ids, expert_ids = r.sorted_token_ids.cpu(), r.expert_ids.cpu()
    n = int(r.num_tokens_post_padded)
    assert n % block == 0 and len(sorted_ids) == padded_length(flat.numel(), block, experts) >= n
    assert (sorted_ids[n:] == flat.numel()).all()
    valid = sorted_ids[:n][sorted_ids[:n] < flat.numel()]
    # A pair routed nowhere (id -1) is in no block.
    assert sorted(valid.tolist()) == (flat >= 0).nonzero().flatten().tolist()
    for b in range(n // block):
        rows = sorted_ids[b * block:(b + 1) * block]
        rows = rows[rows < flat.numel()].long()
        assert len(rows) and (flat[rows] == expert_ids[b]).all()


Call = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def with_unrouted(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  rows: tuple[int, ...] | None = None) -> tuple[Call, Call, torch.Tensor]:
    """A call with slots routed nowhere (id -1), as vLLM's routers give a batch padded to a CUDA
    graph's size: ``rows`` entirely (default: the first and the last, every row when empty),
    and the first slot of row 1 where others stay routed. Returns the call a kernel that
    ``skips_unrouted`` gets (activations of rows routed nowhere NaN and weights of their slots
    0.5: neither may be read), the reference's call (those slots at expert 0 with weight 0,
    finite activations) and the mask of rows with no routed slot (zeros out)."""
    m, topk = ids.shape
    rows = (0, m - 1) if rows is None else rows or tuple(range(m))
    unrouted = torch.zeros_like(ids, dtype=torch.bool)
    unrouted[list(rows)] = True
    if m > 2 and topk > 1 and 1 not in rows:
        unrouted[1, 0] = True
    empty = unrouted.all(dim=1)
    kernel_call = (x.masked_fill(empty[:, None], float("nan")), weights.masked_fill(unrouted, 0.5),
                   ids.masked_fill(unrouted, -1))
    reference_call = (x, weights.masked_fill(unrouted, 0), ids.masked_fill(unrouted, 0))
    return kernel_call, reference_call, empty
