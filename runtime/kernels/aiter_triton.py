"""vLLM's fused-MoE Triton GEMM as aiter ships it (``moe_op.fused_moe``), called twice with the
activation between: the kernel vLLM runs on CUDA, and the one the CUDA rule picks.

The ``aiter_triton*`` kernels share this class: eligibility, activation quantization and the
second GEMM with its top-k reduce. Subclasses change the parameters and the first stage.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from moetune.runtime import aiter_loader
from moetune.runtime.kernels._math import activate
from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights
from moetune.runtime.kernels.triton_config import (
    QUANT_BLOCK, check_config, config_of, config_params)
from moetune.runtime.vllm.configs import vllm_config
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import DType, MoEProblem, QuantScheme

if TYPE_CHECKING:  # _align imports triton, which CPU-only installs lack
    from moetune.runtime.kernels._align import Routing

#: ``stage(x, topk_weights, topk_ids, routing) -> activated intermediate (M * topk, I)``.
Stage = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "Routing"], torch.Tensor]


class AiterTritonKernel(BaseKernel):
    """One config for both GEMMs, as vLLM runs it; the activation is a separate torch op."""

    name = "aiter_triton"
    params = config_params()
    graph_safe = True  # routing by ``_align`` (no host sync), Triton launches sized by shapes
    compiles = True
    #: The aiter modules a kernel runs (keys of ``aiter_loader.MODULES``).
    modules: ClassVar[tuple[str, ...]] = ("moe_op",)
    quants: ClassVar[frozenset[QuantScheme]] = frozenset(QuantScheme)
    #: Launch aiter's persistent kernels (a grid of 2 x SM count looping over tiles) instead.
    persistent: ClassVar[bool] = False

    # --- eligibility -------------------------------------------------------------------------
    @classmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        for module in cls.modules:
            loaded = aiter_loader.load(module)
            if loaded.module is None:
                return loaded.reason
        interpret = aiter_loader.load(cls.modules[0]).interpret
        if sku.vendor is Vendor.CPU:
            if cls.persistent:
                return "aiter's persistent launch sizes its grid by the GPU's SM count"
            if not interpret:
                return "Triton kernels need a GPU (TRITON_INTERPRET=1 runs them slowly on CPU)"
            if problem.dtype is DType.BFLOAT16:
                return "Triton's CPU interpreter computes bfloat16 wrong (numpy has no bfloat16)"
            return None
        if interpret:
            return "TRITON_INTERPRET=1 was set when aiter loaded: kernels would run interpreted"
        if sku.vendor is Vendor.NVIDIA and sku.sm < 80:
            return f"aiter's Triton MoE needs sm_80 or newer, device is {sku.arch}"
        return None

    @classmethod
    def _supports_quant(cls, problem: MoEProblem, sku: SKU) -> str | None:
        if problem.quant not in cls.quants:
            return f"quant scheme {problem.quant.value} not supported"
        if not problem.quant.is_fp8:
            return None
        if sku.vendor is not Vendor.NVIDIA:
            return "fp8 runs on NVIDIA only here (ROCm's gfx942 needs e4m3fnuz, the interpreter has no fp8)"
        if sku.sm < 89:
            return f"fp8 tensor cores need sm_89 or newer, device is {sku.arch}"
        return None

    # --- parameters --------------------------------------------------------------------------
    @classmethod
    def configs(cls, params: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
        """The Triton configs of GEMM1 and GEMM2."""
        config = config_of(params)
        return config, config

    @classmethod
    def seed_params(cls, problem: MoEProblem, sku: SKU) -> dict[str, Any] | None:
        """vLLM's config (the CUDA rule's), so each family starts where serving is."""
        return vllm_config(problem, sku)[0]

    @classmethod
    def check_params(cls, problem: MoEProblem, params: dict[str, Any]) -> str | None:
        for gemm, config in zip(("GEMM1", "GEMM2"), cls.configs(params)):
            reason = check_config(problem, config)
            if reason:
                return f"{gemm}: {reason}"
        return None

    # --- execution ---------------------------------------------------------------------------
    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        from moetune.runtime.kernels._align import align

        config1, config2 = cls.configs(params)
        first = cls.first_stage(problem, weights, config1)
        moe_op = aiter_loader.load("moe_op").module
        gemm2 = bind_gemm(moe_op.fused_moe, problem, weights.w2, weights.w2_scale, config2,
                          persistent=cls.persistent)
        num_experts, hidden = weights.w2.shape[0], weights.w2.shape[1]
        block_m1, block_m2 = config1["BLOCK_SIZE_M"], config2["BLOCK_SIZE_M"]
        mul_weight = not problem.router_weight_on_input

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
            m, topk = topk_ids.shape
            routing1 = align(topk_ids, block_m1, num_experts)
            routing2 = routing1 if block_m2 == block_m1 else align(topk_ids, block_m2, num_experts)
            h = first(x, topk_weights, topk_ids, routing1)
            y = x.new_empty(m, topk, hidden)
            gemm2(h, y, topk_weights, topk_ids, routing2, mul_weight, 1)
            return y.sum(dim=1)

        return run

    @classmethod
    def first_stage(cls, problem: MoEProblem, weights: MoEWeights, config: dict[str, int]) -> Stage:
        """GEMM1 then the activation as a torch op (any activation, gated or not)."""
        moe_op = aiter_loader.load("moe_op").module
        gemm1 = bind_gemm(moe_op.fused_moe, problem, weights.w13, weights.w13_scale, config,
                          persistent=cls.persistent)
        n = weights.w13.shape[1]
        on_input = problem.router_weight_on_input

        def stage(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  routing: Routing) -> torch.Tensor:
            m, topk = topk_ids.shape
            h = x.new_empty(m, topk, n)
            gemm1(x, h, topk_weights, topk_ids, routing, on_input, topk)
            return activate(h.view(m * topk, n), problem)

        return stage


def bind_gemm(fn: Callable[..., Any], problem: MoEProblem, w: torch.Tensor,
              w_scale: torch.Tensor | None, config: dict[str, int], *,
              persistent: bool = False) -> Callable[..., None]:
    """One aiter grouped GEMM (``fused_moe`` or a fused variant) bound to weights, quantization
    and config: ``gemm(a, out, topk_weights, topk_ids, routing, mul_routed_weight, top_k)``.

    ``persistent`` picks aiter's persistent kernel. aiter selects it by a module-level flag
    (``moe_set_use_persistent_kernel``), read when the wrapper launches: the flag is set for this
    call only and restored, so other callers of the module see what they set.

    Activations are quantized as vLLM does for each scheme: per tensor inside aiter's wrapper,
    per token for per-channel weights (run as 1 x K scale blocks, the only per-row-scale path
    aiter's kernel has), per 128-column group for block-fp8 weights.
    """
    import triton.language as tl

    compute_type = {DType.FLOAT32: tl.float32, DType.FLOAT16: tl.float16,
                    DType.BFLOAT16: tl.bfloat16}[problem.dtype]
    quant = problem.quant
    block_shape: list[int] | None = None
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] = _no_quant
    if quant is QuantScheme.FP8_PER_CHANNEL:
        from moetune.runtime.kernels._act_quant import quantize_rows

        block_shape, quantize = [1, w.shape[2]], quantize_rows
        w_scale = w_scale.unsqueeze(-1).contiguous() if w_scale is not None else None
    elif quant is QuantScheme.FP8_BLOCK_128X128:
        from moetune.runtime.kernels._act_quant import quantize_rows

        block_shape = list(QUANT_BLOCK)
        quantize = functools.partial(quantize_rows, group=QUANT_BLOCK[1])
    # moe_op and silu_fused take int4 zero points; the gelu variant has no such arguments.
    takes_zp = "B_zp" in inspect.signature(fn).parameters
    extra = {"B_zp": None, "use_int4_w4a16": False} if takes_zp else {}

    launch_mode = _persistent_flag(fn, persistent)

    def gemm(a: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             routing: Routing, mul_routed_weight: bool, top_k: int) -> None:
        a, a_scale = quantize(a)
        with launch_mode:
            fn(A=a, B=w, C=out, A_scale=a_scale, B_scale=w_scale, topk_weights=topk_weights,
               topk_ids=topk_ids, sorted_token_ids=routing.sorted_token_ids,
               expert_ids=routing.expert_ids, num_tokens_post_padded=routing.num_tokens_post_padded,
               mul_routed_weight=mul_routed_weight, top_k=top_k, compute_type=compute_type,
               use_fp8_w8a8=quant.is_fp8, use_int8_w8a16=False, block_shape=block_shape,
               config=config, **extra)

    return gemm


class _PersistentFlag:
    """Sets an aiter MoE module's persistent-kernel flag for the duration of one launch."""

    def __init__(self, module_globals: dict[str, Any]) -> None:
        self._globals = module_globals
        self._saved = False

    def __enter__(self) -> None:
        self._saved = self._globals[_FLAG]
        self._globals[_FLAG] = True

    def __exit__(self, *exc: object) -> None:
        self._globals[_FLAG] = self._saved


_FLAG = "_USE_MOE_PERSISTENT_KERNEL"


def _persistent_flag(fn: Callable[..., Any],
                     persistent: bool) -> contextlib.AbstractContextManager[None]:
    if not persistent:
        return contextlib.nullcontext()
    if _FLAG not in fn.__globals__:
        raise TypeError(f"{fn.__module__}.{fn.__name__} has no persistent kernel ({_FLAG} missing)")
    return _PersistentFlag(fn.__globals__)


def _no_quant(a: torch.Tensor) -> tuple[torch.Tensor, None]:
    return a, None
