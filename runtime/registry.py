"""Kernel names -> classes, resolved lazily so optional backends load only when asked for."""

from __future__ import annotations

import importlib
from typing import Iterator

from moetune.errors import UnknownKernelError
from moetune.runtime.kernels.base import BaseKernel
from moetune.runtime.platform import SKU
from moetune.runtime.problem import MoEProblem

#: Every kernel moetune knows. Stable names: tables store them.
KERNEL_PATHS: dict[str, str] = {
    "reference": "moetune.runtime.kernels.reference:ReferenceKernel",
    "torch_loop": "moetune.runtime.kernels.torch_loop:TorchLoopKernel",
    "torch_grouped": "moetune.runtime.kernels.torch_grouped:TorchGroupedKernel",
    "torch_dense": "moetune.runtime.kernels.torch_dense:TorchDenseKernel",
    "torch_scaled_grouped": "moetune.runtime.kernels.torch_scaled_grouped:TorchScaledGroupedKernel",
    "vllm_cpu_experts": "moetune.runtime.kernels.vllm_cpu_experts:VllmCpuExpertsKernel",
    "vllm_triton": "moetune.runtime.kernels.vllm_triton:VllmTritonKernel",
    "vllm_triton_tuned": "moetune.runtime.kernels.vllm_triton:VllmTritonTunedKernel",
    "vllm_deepgemm": "moetune.runtime.kernels.vllm_deepgemm:VllmDeepGemmKernel",
    "flashinfer_cutlass": "moetune.runtime.kernels.flashinfer_cutlass:FlashInferCutlassKernel",
    "aiter_triton": "moetune.runtime.kernels.aiter_triton:AiterTritonKernel",
    "aiter_triton_split": "moetune.runtime.kernels.aiter_triton:AiterTritonSplitKernel",
    "aiter_triton_silu_fused": "moetune.runtime.kernels.aiter_triton:AiterTritonSiluFusedKernel",
    "aiter_triton_gelu_fused": "moetune.runtime.kernels.aiter_triton:AiterTritonGeluFusedKernel",
    "aiter_triton_persistent": "moetune.runtime.kernels.aiter_triton:AiterTritonPersistentKernel",
    "aiter_triton_silu_fused_persistent":
        "moetune.runtime.kernels.aiter_triton:AiterTritonSiluFusedPersistentKernel",
    "aiter_triton_gelu_fused_persistent":
        "moetune.runtime.kernels.aiter_triton:AiterTritonGeluFusedPersistentKernel",
    "aiter_triton_e2e": "moetune.runtime.kernels.aiter_triton_e2e:AiterTritonE2EKernel",
    "aiter_fused_moe": "moetune.runtime.kernels.aiter_fused_moe:AiterFusedMoeKernel",
    "aiter_asm_tkw1": "moetune.runtime.kernels.aiter_asm_tkw1:AiterAsmTkw1Kernel",
    "aiter_asm_blockscale": "moetune.runtime.kernels.aiter_asm_blockscale:AiterAsmBlockscaleKernel",
    "moetune_decode": "moetune.runtime.kernels.moetune_decode:MoetuneDecodeKernel",
    "moetune_decode_one": "moetune.runtime.kernels.moetune_decode_one:MoetuneDecodeOneKernel",
    "moetune_grouped": "moetune.runtime.kernels.moetune_grouped:MoetuneGroupedKernel",
    "moetune_grouped_mm": "moetune.runtime.kernels.moetune_grouped_mm:MoetuneGroupedMMKernel",
}


class Registry:
    """A name -> kernel map. The default one holds ``KERNEL_PATHS``; tests build their own."""

    def __init__(self, paths: dict[str, str] | None = None) -> None:
        self._paths = dict(KERNEL_PATHS if paths is None else paths)
        self._loaded: dict[str, type[BaseKernel]] = {}

    def add(self, kernel: type[BaseKernel]) -> None:
        self._loaded[kernel.name] = kernel
        self._paths.setdefault(kernel.name, f"{kernel.__module__}:{kernel.__qualname__}")

    def paths(self) -> dict[str, str]:
        """Name -> ``module:Class`` of every kernel (how another process rebuilds this registry)."""
        return dict(self._paths)

    def names(self) -> list[str]:
        return list(self._paths)

    def __contains__(self, name: str) -> bool:
        return name in self._paths

    def get(self, name: str) -> type[BaseKernel]:
        """The kernel class called ``name``.

        Raises:
            UnknownKernelError: ``name`` is not registered (the message lists what is).
        """
        if name in self._loaded:
            return self._loaded[name]
        if name not in self._paths:
            raise UnknownKernelError(f"unknown kernel {name!r}; known: {', '.join(self._paths)}")
        module, _, attr = self._paths[name].partition(":")
        try:
            kernel = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise UnknownKernelError(
                f"kernel {name!r} could not be imported ({e}); it may need an optional dependency"
            ) from e
        self._loaded[name] = kernel
        return kernel

    def __iter__(self) -> Iterator[type[BaseKernel]]:
        return (self.get(n) for n in self._paths)

    def eligibility(self, problem: MoEProblem, sku: SKU) -> dict[str, str | None]:
        """Every kernel's verdict for ``problem``: None if eligible, else the reason."""
        verdicts: dict[str, str | None] = {}
        for name in self._paths:
            try:
                ok, reason = self.get(name).supports(problem, sku)
            except UnknownKernelError as e:
                ok, reason = False, str(e)
            verdicts[name] = None if ok else reason
        return verdicts

    def candidates(self, problem: MoEProblem, sku: SKU) -> list[type[BaseKernel]]:
        """Eligible kernels that take part in tuning."""
        return [self.get(n) for n, why in self.eligibility(problem, sku).items()
                if why is None and self.get(n).candidate]


default_registry = Registry()
