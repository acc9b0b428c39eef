"""``aiter_triton_split`` launched as aiter's persistent kernels: a grid of twice the SM count
whose programs loop over the output tiles, instead of one program per tile. It saves launch and
tail cost when tiles far outnumber SMs; the search decides where that pays."""

from __future__ import annotations

from moetune.runtime.kernels.aiter_triton_split import AiterTritonSplitKernel


class AiterTritonPersistentKernel(AiterTritonSplitKernel):
    """Both GEMMs persistent, each with its own config."""

    name = "aiter_triton_persistent"
    persistent = True
