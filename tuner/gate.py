"""The correctness gate: a candidate's output against the float32 reference."""

from __future__ import annotations

import torch

from moetune.runtime.problem import DType, MoEProblem, QuantScheme

# Relative Frobenius error allowed. bf16 keeps 8 mantissa bits (~4e-3 per value) and errors
# grow through two GEMMs and an activation; fp8 e4m3 keeps 3 bits and quantizes activations too.
_TOLERANCE = {DType.FLOAT32: 1e-4, DType.FLOAT16: 1e-2, DType.BFLOAT16: 2.5e-2}
_FP8_TOLERANCE = 8e-2


def tolerance(problem: MoEProblem) -> float:
    if problem.quant is not QuantScheme.NONE:
        return _FP8_TOLERANCE
    return _TOLERANCE[problem.dtype]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32; inf when the output has NaN/inf or the wrong shape."""
    if out.shape != ref.shape:
        return float("inf")
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def poison_allocator(device: str, nbytes: int) -> None:
    """Leave NaN in freed memory so a kernel that skips output elements reads as wrong.

    The caching allocators hand the next ``empty`` the block just freed; best effort on CPU.
    """
    junk = torch.full((max(nbytes // 4, 1),), float("nan"), device=device)
    del junk
