"""Random weights and batches for a problem: what the tuner times and checks kernels on."""

from __future__ import annotations

import dataclasses
import enum

import torch

from moetune.runtime.kernels.base import MoEWeights
from moetune.runtime.kernels.quant import BLOCK, quantize_weights
from moetune.runtime.problem import MoEProblem, QuantScheme


class Routing(str, enum.Enum):
    """How tokens pick experts: near-uniform (vLLM's tuner) or skewed like real traffic."""

    UNIFORM = "uniform"
    ZIPF = "zipf"


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x, self.topk_weights, self.topk_ids

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.args())


def _dtype(problem: MoEProblem) -> torch.dtype:
    return getattr(torch, problem.dtype.value)


def make_weights(problem: MoEProblem, device: str, seed: int = 0) -> MoEWeights:
    """Weights scaled by 1/sqrt(fan_in) so outputs stay O(1) in every dtype.

    Drawn on ``device`` itself: a model's experts are gigabytes, too slow to draw on a CPU.
    Drawn and quantized one expert at a time into the final tensors, and the allocator's cache
    emptied after, so a process holds the weights alone: drawing a whole DeepSeek-V3 shard in
    float32 and quantizing it peaked at 18 GiB, which each of the tuner's processes kept.
    For fp8 each quantization group (expert, row or 128x128 block) is scaled by its own
    factor first, so no two scales agree and a kernel that applies a scale to the wrong group
    (transposed, shifted, another expert's) fails the correctness gate.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = problem.num_experts, problem.hidden_size, problem.intermediate_size
    n1 = 2 * i if problem.gated else i
    names = ("w13", "w2", "w13_scale", "w2_scale") if problem.quant.is_fp8 else ("w13", "w2")
    weights = MoEWeights(torch.empty(0), torch.empty(0), problem.quant)
    for j in range(e):
        part = _expert(problem, (n1, h), (h, i), gen, device)
        for name in names:
            t = getattr(part, name)
            if j == 0:
                setattr(weights, name, t.new_empty((e, *t.shape[1:])))
            getattr(weights, name)[j] = t[0]
        del part
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return weights


def _expert(problem: MoEProblem, shape13: tuple[int, int], shape2: tuple[int, int],
            gen: torch.Generator, device: str) -> MoEWeights:
    """One expert's weights (as a batch of one), in the problem's dtype or quant scheme."""
    w13 = torch.randn(1, *shape13, generator=gen, device=device) / shape13[1] ** 0.5
    w2 = torch.randn(1, *shape2, generator=gen, device=device) / shape2[1] ** 0.5
    if problem.quant.is_fp8:
        w13, w2 = _spread_groups(w13, problem.quant, gen), _spread_groups(w2, problem.quant, gen)
    weights = quantize_weights(w13, w2, problem.quant)
    if problem.quant is QuantScheme.NONE:
        weights.w13, weights.w2 = weights.w13.to(_dtype(problem)), weights.w2.to(_dtype(problem))
    return weights


def _spread_groups(w: torch.Tensor, scheme: QuantScheme, gen: torch.Generator) -> torch.Tensor:
    """``w`` (E, N, K) with each of ``scheme``'s quantization groups scaled by 2**U(-2, 2)."""
    e, n, k = w.shape
    groups = {QuantScheme.FP8_PER_TENSOR: (e, 1, 1), QuantScheme.FP8_PER_CHANNEL: (e, n, 1),
              QuantScheme.FP8_BLOCK_128X128: (e, -(-n // BLOCK), -(-k // BLOCK))}[scheme]
    factor = 2.0 ** (torch.rand(groups, generator=gen, device=w.device) * 4 - 2)
    if scheme is QuantScheme.FP8_BLOCK_128X128:
        factor = factor.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :n, :k]
    return w * factor


def make_batch(problem: MoEProblem, device: str, seed: int,
               routing: Routing = Routing.UNIFORM) -> Batch:
    """Activations and a routing decision for ``problem.num_tokens`` tokens."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    m, e, k = problem.num_tokens, problem.num_experts, problem.topk
    x = torch.randn(m, problem.hidden_size, generator=gen)
    if routing is Routing.UNIFORM:
        logits = torch.randn(m, e, generator=gen)
    else:  # expert r is picked with probability ~ 1/(r+1): a few hot experts, a long tail
        probs = 1.0 / torch.arange(1, e + 1, dtype=torch.float32)
        perm = torch.randperm(e, generator=gen)
        logits = (probs[perm].log().expand(m, e) + 0.5 * torch.randn(m, e, generator=gen))
    topk_weights, topk_ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return Batch(x.to(_dtype(problem)).to(device), topk_weights.to(device),
                 topk_ids.to(torch.int32).to(device))
