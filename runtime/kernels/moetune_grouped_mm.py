"""moetune's prefill MoE kernel on torch's grouped GEMMs: the two GEMMs of every expert in one
``torch._grouped_mm`` launch each (CUTLASS on sm_90: warp-specialized, TMA-fed tensor cores,
which Triton 3.6 does not generate for moetune_grouped's loops there), with Triton passes
between them (``_grouped_mm`` says what each does).

Where a layer is compute-bound (prefill of wide experts) the GEMMs' speed is what counts, and
the passes cost bytes: the sorted input, GEMM1's (pairs, 2I) output and GEMM2's (pairs, H) rows
each go through memory once more than in moetune_grouped. The search weighs the two per bucket.
Unlike ``torch_grouped`` (torch's own sort, gather, activation and sum: a host sync and a
dozen launches) it routes on the device, so it runs inside CUDA graphs.
"""

from __future__ import annotations

from typing import Any

from moetune.runtime.kernels._own_triton import OwnTritonKernel
from moetune.runtime.kernels.base import MoEFn, MoEWeights
from moetune.runtime.kernels.torch_grouped import grouped_mm_dtype_reason, grouped_mm_missing
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem, QuantScheme


class MoetuneGroupedMMKernel(OwnTritonKernel):
    """Two ``torch._grouped_mm`` GEMMs over pairs sorted by expert; bf16 on sm_90+ (what the
    CUDA build runs), float32/float16 on the CPU under Triton's interpreter (plumbing tests)."""

    name = "moetune_grouped_mm"
    deterministic = True  # top-k rows summed in slot order, no atomics (``_grouped_mm``)
    kernels_module = "moetune.runtime.kernels._grouped_mm"
    vendors = frozenset({Vendor.NVIDIA, Vendor.CPU})  # _grouped_mm is not built for ROCm here
    min_sm = 90
    quants = frozenset({QuantScheme.NONE})
    # The grouped GEMM needs 16-byte aligned rows: 8 bf16 elements.
    hidden_align = intermediate_align = 8

    @classmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        return grouped_mm_missing() or super()._supports_device(problem, sku)

    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        return grouped_mm_dtype_reason(problem, sku) or super()._supports_problem(problem, sku)

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        from moetune.runtime.kernels._grouped_mm import launcher

        return launcher(problem, weights)
