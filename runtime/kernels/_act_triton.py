"""The activation of moetune's Triton kernels, in one place: the code a launcher passes as the
``ACT`` constexpr and the device function that applies it to GEMM1's gate and up halves."""

from __future__ import annotations

import triton
import triton.language as tl

from moetune.runtime.problem import Activation, MoEProblem

ACT_SILU, ACT_GELU = 0, 1


def act_code(problem: MoEProblem) -> int:
    """The ``ACT`` constexpr for ``problem``'s activation."""
    return ACT_SILU if problem.activation is Activation.SILU else ACT_GELU


@triton.jit
def gated_act(gate, up, ACT: tl.constexpr, GATED: tl.constexpr):
    """``act(gate) * up`` (``act(gate)`` where the layer is not gated; ``up`` is then unused), in
    float32: SiLU, or GELU in its exact erf form as torch's default."""
    if ACT == 0:  # ACT_SILU (a literal: the jit reads no plain module globals)
        act = gate / (1.0 + tl.exp(-gate))
    else:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    if GATED:
        act = act * up
    return act
