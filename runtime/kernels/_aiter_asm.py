"""What aiter's ROCm MoE kernels (asm and CK, behind ``aiter.fused_moe`` and ``asm_moe*``) share.

Each kernel makes one aiter call, declared as data (``aiter_call``: module, function, keyword
names) so the contract tests can check it against the installed aiter sources without ROCm.
``import aiter`` builds HIP extensions, so it happens in ``prepare`` only, never at import time.

Weights: these kernels read aiter's shuffled layout (``shuffle_weight(w, layout=(16, 16))``,
which marks the tensor ``is_shuffled``, as vLLM does at load) and the device's fp8
(e4m3fnuz on gfx942, e4m3fn on gfx950). Serving hands them vLLM's shuffled weights; the tuner
hands plain e4m3fn ones, which ``aiter_weights`` converts once, outside the timed call.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from moetune.runtime.kernels.base import BaseKernel, MoEWeights, WeightLayout
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import Activation, DType, MoEProblem, QuantScheme

#: (module, function, keyword names passed): one call into aiter.
AiterCall = tuple[str, str, tuple[str, ...]]

#: Archs with aiter's asm ``.co`` kernels (the wheel ships gfx942 and gfx950 only).
AITER_ARCHES = ("gfx942", "gfx950")
#: How vLLM shuffles MoE weights at load for its AITER backend.
SHUFFLE_CALL: AiterCall = ("aiter.ops.shuffle", "shuffle_weight", ("layout",))
SHUFFLE_LAYOUT = (16, 16)


class BaseAiterKernel(BaseKernel):
    """An aiter ROCm MoE kernel: gated layers, bf16/fp16 activations, shuffled weights.

    MUST set: ``name``, ``aiter_call``, ``quants``, ``prepare``.
    MAY set the other capability fields (``amd_archs``, ``dtypes``, ...); MAY override
    ``_supports_routing``.
    """

    layout = WeightLayout.AITER_SHUFFLED
    aiter_call: ClassVar[AiterCall]
    vendors = frozenset({Vendor.AMD})
    amd_archs = AITER_ARCHES
    requires = ("aiter",)
    dtypes = frozenset({DType.BFLOAT16, DType.FLOAT16})
    activations = frozenset({Activation.SILU, Activation.GELU})
    gated = True  # as vLLM's AiterExperts
    # shuffle_weight tiles (16 rows x 32 columns) of both weight matrices.
    hidden_align = intermediate_align = 32

    @classmethod
    def aiter_calls(cls) -> tuple[AiterCall, ...]:
        """Every aiter function ``prepare`` and the prepared callable use."""
        return (SHUFFLE_CALL, cls.aiter_call)

    @classmethod
    def unsupported(cls, problem: MoEProblem, sku: SKU) -> str | None:
        """Why ``sku`` cannot run ``problem`` with this kernel whatever this machine has
        installed (what an imported table row is checked against), or None."""
        return (cls._supports_sku(sku) or cls._supports_quant(problem, sku)
                or cls._supports_problem(problem, sku))

    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        return super()._supports_problem(problem, sku) or cls._supports_routing(problem)

    @classmethod
    def _supports_routing(cls, problem: MoEProblem) -> str | None:
        """Where the router weight may apply; vLLM asserts top-1 for weight-on-input."""
        if problem.router_weight_on_input and problem.topk != 1:
            return "router weight on input needs topk 1 (vLLM asserts it for aiter)"
        return None


def import_aiter() -> Any:
    """The real ``aiter`` package (on ROCm its init loads the HIP extensions)."""
    return importlib.import_module("aiter")


def aiter_function(call: AiterCall) -> Callable[..., Any]:
    module, function, _ = call
    import_aiter()
    return getattr(importlib.import_module(module), function)


def aiter_weights(weights: MoEWeights) -> tuple[torch.Tensor, torch.Tensor,
                                                 torch.Tensor | None, torch.Tensor | None]:
    """(w13, w2, w13_scale, w2_scale) as aiter reads them: the device's fp8, shuffled, and
    per-channel scales as (E, N, 1). Weights already marked ``is_shuffled`` are not shuffled."""
    fp8 = import_aiter().dtypes.fp8
    shuffle = aiter_function(SHUFFLE_CALL)
    out = []
    for w, scale in ((weights.w13, weights.w13_scale), (weights.w2, weights.w2_scale)):
        shuffled = bool(getattr(w, "is_shuffled", False))
        w, scale = _device_fp8(w, scale, fp8)
        if shuffled:
            w.is_shuffled = True  # type: ignore[attr-defined]
        else:
            w = shuffle(w, layout=SHUFFLE_LAYOUT)
        if scale is not None and weights.quant is QuantScheme.FP8_PER_CHANNEL:
            scale = scale.reshape(scale.shape[0], -1, 1)
        out += [w, scale]
    return out[0], out[2], out[1], out[3]


def _device_fp8(w: torch.Tensor, scale: torch.Tensor | None,
                fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """e4m3fn -> e4m3fnuz where the device needs it (vLLM's ``normalize_e4m3fn_to_e4m3fnuz``):
    the same bits read as half the value, so scales double; -128 (fn's -0) would be NaN."""
    if w.dtype != torch.float8_e4m3fn or fp8 != torch.float8_e4m3fnuz:
        return w, scale
    bits = w.view(torch.int8).clone()
    bits[bits == -128] = 0
    return bits.view(torch.float8_e4m3fnuz), None if scale is None else scale * 2.0
