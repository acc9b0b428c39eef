"""The correctness gate: a candidate's output against the float32 reference."""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Callable, Iterator

import torch

from moetune.runtime.problem import DType, MoEProblem, QuantScheme

# Relative Frobenius error allowed. bf16 keeps 8 mantissa bits (~4e-3 per value) and errors
# grow through two GEMMs and an activation; fp8 e4m3 keeps 3 bits and quantizes activations too.
_TOLERANCE = {DType.FLOAT32: 1e-4, DType.FLOAT16: 1e-2, DType.BFLOAT16: 2.5e-2}
_FP8_TOLERANCE = 8e-2
# On GPUs Triton's float32 dot runs on TF32 tensor cores (10 mantissa bits), vLLM's own fused-MoE
# kernel included: measured on an H200 at 2.4e-3 from the float32 reference at tiny shapes.
_TF32_TOLERANCE = 1e-2


def tolerance(problem: MoEProblem, device: str = "cpu") -> float:
    """The error a correct kernel for ``problem`` stays within on ``device``."""
    if problem.quant is not QuantScheme.NONE:
        return _FP8_TOLERANCE
    if problem.dtype is DType.FLOAT32 and not device.startswith("cpu"):
        return _TF32_TOLERANCE
    return _TOLERANCE[problem.dtype]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32; inf when the output has NaN/inf or the wrong shape."""
    if out.shape != ref.shape:
        return float("inf")
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


@contextlib.contextmanager
def poisoned_allocations(device: str, nbytes: int) -> Iterator[None]:
    """While a candidate is checked, make memory it allocates but never writes read as wrong.

    CPU with glibc: malloc fills every new block with 0x7F bytes (``M_PERTURB``), huge or NaN
    in every float format, so skipped output elements fail the gate deterministically. CUDA
    (and other C libraries): NaN is left in ``nbytes`` of freed memory, which the caching
    allocator hands the next ``empty`` of that size; best effort.
    """
    mallopt = _glibc_mallopt() if not device.startswith("cuda") else None
    if mallopt is None:
        torch.full((max(nbytes // 4, 1),), float("nan"), device=device)  # freed at once
        yield
        return
    mallopt(_M_PERTURB, 0x80)  # new blocks hold ~0x80 = 0x7F bytes
    try:
        yield
    finally:
        mallopt(_M_PERTURB, 0)


_M_PERTURB = -6  # glibc's malloc.h


@functools.cache
def _glibc_mallopt() -> Callable[[int, int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").mallopt  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None
