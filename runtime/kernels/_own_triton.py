"""What moetune's own Triton kernels (``moetune_decode``, ``moetune_grouped``) share: where they
run, which fp8 they compute, how their parameters are looked up, and when their atomic reduces
make a call's bits differ from the next."""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from moetune.runtime.kernels._interpreter import interpreter_reason
from moetune.runtime.kernels.base import BaseKernel
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem, QuantScheme


class OwnTritonKernel(BaseKernel):
    """A moetune Triton kernel: NVIDIA sm_80+ and ROCm gfx942/gfx950, compiled per config,
    routing on the device (graph-safe), every quant scheme where the device has fp8 e4m3fn."""

    graph_safe = True  # expert ids are read on the device; launches are sized by shapes only
    compiles = True
    min_sm = 80
    amd_archs = ("gfx942", "gfx950")
    requires = ("triton",)
    quants = frozenset(QuantScheme)
    #: The module defining the Triton kernels; it records ``INTERPRET`` when it defines them
    #: (imported only when eligibility is asked, so CPU-only installs need no triton).
    kernels_module: ClassVar[str]

    @classmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        reason = super()._supports_device(problem, sku)
        if reason:
            return reason
        return interpreter_reason(problem, sku,
                                  importlib.import_module(cls.kernels_module).INTERPRET)

    @classmethod
    def _supports_quant(cls, problem: MoEProblem, sku: SKU) -> str | None:
        if problem.quant.is_fp8:
            if sku.vendor is Vendor.CPU:
                return "fp8 does not run in Triton's CPU interpreter (numpy has no fp8)"
            if sku.vendor is Vendor.NVIDIA and sku.sm < 89:
                return f"fp8 e4m3 needs sm_89 or newer, device is {sku.arch}"
            if sku.vendor is Vendor.AMD and sku.arch != "gfx950":
                return (f"moetune's fp8 is e4m3fn (OCP); {sku.arch} computes e4m3fnuz "
                        "(gfx950 has e4m3fn)")
        return super()._supports_quant(problem, sku)

    @classmethod
    def choices(cls, name: str) -> tuple[Any, ...]:
        """The searched values of parameter ``name``."""
        return next(p.choices for p in cls.params if p.name == name)


def atomic_order_reason(reduce: str, addends: int) -> str | None:
    """Why a reduce may give other bits in another call: atomics adding more than two values
    into one element, in the order the GPU runs them (float addition is not associative); None
    for an ordered reduce or at most two addends (``0 + a + b`` is ``0 + b + a``)."""
    if reduce not in ("atomic", "atomic_out") or addends <= 2:
        return None
    return (f"REDUCE={reduce} adds {addends} partial rows into each output row with atomics, "
            "in the order the GPU runs them")

