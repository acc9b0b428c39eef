"""Pieces of the MoE layer that the torch kernels share: activation and the routed sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetune.runtime.problem import Activation, MoEProblem


def activate(h: torch.Tensor, problem: MoEProblem) -> torch.Tensor:
    """``act(gate) * up`` for gated layers (gate is the first half of GEMM1's output), else ``act(h)``."""
    fn = F.silu if problem.activation is Activation.SILU else F.gelu
    if not problem.gated:
        return fn(h)
    gate, up = h.chunk(2, dim=-1)
    return fn(gate) * up

