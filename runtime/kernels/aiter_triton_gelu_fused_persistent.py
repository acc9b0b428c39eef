"""``aiter_triton_gelu_fused`` with both GEMMs launched as aiter's persistent kernels."""

from __future__ import annotations

from moetune.runtime.kernels.aiter_triton_gelu_fused import AiterTritonGeluFusedKernel


class AiterTritonGeluFusedPersistentKernel(AiterTritonGeluFusedKernel):
    """Ungated GELU fused into a persistent GEMM1; persistent GEMM2."""

    name = "aiter_triton_gelu_fused_persistent"
    persistent = True
