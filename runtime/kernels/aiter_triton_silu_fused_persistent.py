"""``aiter_triton_silu_fused`` with both GEMMs launched as aiter's persistent kernels
(``_fused_moe_persistent_silu_kernel`` for GEMM1)."""

from __future__ import annotations

from moetune.runtime.kernels.aiter_triton_silu_fused import AiterTritonSiluFusedKernel


class AiterTritonSiluFusedPersistentKernel(AiterTritonSiluFusedKernel):
    """Gated SiLU fused into a persistent GEMM1; persistent GEMM2."""

    name = "aiter_triton_silu_fused_persistent"
    persistent = True
