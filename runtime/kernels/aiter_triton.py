"""aiter's fork of an older vLLM fused-MoE Triton GEMM (``moe_op.fused_moe``), called twice with
the activation between: a candidate family of its own, and the CUDA rule's emulation of vLLM
where vLLM's own path (``vllm_triton``) is not installed. It takes vLLM's config keys but is not
vLLM's code: vLLM 0.34's path ran 0.6-34% faster per bucket on an H100 with the same configs
(``bench/results/vllm-baseline-h100-2026-12-07/``).

Its variants are the table at the end of this module. Each differs from it in three choices:

* a config per GEMM: vLLM runs GEMM1 (M x 2I x H) and GEMM2 (M x H x I) with one config
  although their shapes differ by far; SGLang tunes them apart. Parameters are prefixed ``g1_``
  and ``g2_``; when the two BLOCK_SIZE_M differ the routing is aligned once per GEMM.
* what GEMM1 fuses into its epilogue (``Gemm1``): nothing (the activation is a torch op), gated
  SiLU-and-mul (aiter's ``moe_op_silu_fused``) or ungated GELU (``moe_op_gelu``): one pass less
  over the (M * topk, 2I) intermediate; each computes only some layers, declared with it.
* persistent launches: a grid of twice the SM count whose programs loop over the output tiles,
  instead of one program per tile. It saves launch and tail cost when tiles far outnumber SMs;
  the search decides where that pays.

Every variant shares the device rules, activation quantization and the second GEMM with its
top-k reduce, summed into the caller's output when it passes one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from moetune.runtime import aiter_loader
from moetune.runtime.kernels._interpreter import interpreter_reason
from moetune.runtime.kernels._math import activate
from moetune.runtime.kernels.base import BaseKernel, MoEFn, MoEWeights
from moetune.runtime.kernels.triton_config import (
    QUANT_BLOCK, check_config, config_of, config_params, vllm_config, with_prefix)
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import Activation, DType, MoEProblem, QuantScheme

if TYPE_CHECKING:  # _align imports triton, which CPU-only installs lack
    from moetune.runtime.kernels._align import Routing

#: ``stage(x, topk_weights, topk_ids, routing) -> activated intermediate (M * topk, I)``.
Stage = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "Routing"], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Gemm1:
    """GEMM1 of a variant: an aiter function (``module`` is an ``aiter_loader`` key).

    ``fused``: the activation is in its epilogue, so it writes the activated (M * topk, I);
    otherwise it writes (M * topk, N) and a torch op activates that. ``flat``: its output is
    2-D (M * topk, ...) rather than (M, topk, ...). ``limits``: the layers it computes, as
    ``BaseKernel`` capability fields.
    """

    module: str
    function: str
    doc: str
    fused: bool = False
    flat: bool = False
    limits: dict[str, Any] = dataclasses.field(default_factory=dict)


UNFUSED = Gemm1("moe_op", "fused_moe", "the activation a separate torch op")
#: The kernel interleaves gate and up columns inside each N tile and writes BLOCK_SIZE_N / 2
#: activated columns into a 2-D (M * topk, I) output, indexed by the flat (token * topk + slot)
#: id (``stride_cm`` is the output's first stride). A 3-D (M, topk, I) output makes those rows
#: stride ``topk`` times too far: the illegal memory access once seen on an H200.
SILU_FUSED = Gemm1("silu_fused", "fused_moe_silu", "gated SiLU fused into GEMM1", fused=True,
                   flat=True, limits={"activations": frozenset({Activation.SILU}), "gated": True})
#: What aiter's kernel computes decides what is eligible: GELU of the whole output (ungated
#: layers), tanh-approximated (~2e-4 from exact GELU: beyond the float32 gate's 1e-4, so float16
#: and bfloat16 only); it skips the GELU when it multiplies the router weight, so
#: router-weight-on-input layers cannot use it; per-tensor fp8 quantizes activations to ROCm's
#: e4m3fnuz; and it swaps the block shape's (n, k), so only square scale blocks are right.
GELU_FUSED = Gemm1("gelu", "fused_moe_gelu", "ungated GELU fused into GEMM1", fused=True,
                   limits={"activations": frozenset({Activation.GELU}), "gated": False,
                           "router_weight_on_input": False,
                           "dtypes": frozenset({DType.FLOAT16, DType.BFLOAT16}),
                           "quants": frozenset({QuantScheme.NONE,
                                                QuantScheme.FP8_BLOCK_128X128})})


class AiterTritonKernel(BaseKernel):
    """One config for both GEMMs, as vLLM runs it; the activation is a separate torch op."""

    name = "aiter_triton"
    deterministic = True  # GEMM2 writes each (token, slot) row; ``torch.sum`` over top-k
    params = config_params()
    graph_safe = True  # routing by ``_align`` (no host sync), Triton launches sized by shapes
    compiles = True
    min_sm = 80
    quants = frozenset(QuantScheme)
    #: The aiter modules a kernel runs (keys of ``aiter_loader.MODULES``).
    modules: ClassVar[tuple[str, ...]] = ("moe_op",)
    gemm1: ClassVar[Gemm1] = UNFUSED
    #: A Triton config per GEMM (parameters ``g1_*`` and ``g2_*``) instead of one for both.
    split: ClassVar[bool] = False
    #: Launch aiter's persistent kernels (a grid of 2 x SM count looping over tiles) instead.
    persistent: ClassVar[bool] = False

    # --- eligibility -------------------------------------------------------------------------
    @classmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        reason = super()._supports_device(problem, sku)
        if reason:
            return reason
        for module in cls.modules:
            loaded = aiter_loader.load(module)
            if loaded.module is None:
                return loaded.reason
        return interpreter_reason(problem, sku, aiter_loader.load(cls.modules[0]).interpret)

    @classmethod
    def _supports_quant(cls, problem: MoEProblem, sku: SKU) -> str | None:
        reason = super()._supports_quant(problem, sku)
        if reason or not problem.quant.is_fp8:
            return reason
        if sku.vendor is not Vendor.NVIDIA:
            return "fp8 runs on NVIDIA only here (ROCm's gfx942 needs e4m3fnuz, the interpreter has no fp8)"
        if sku.sm < 89:
            return f"fp8 tensor cores need sm_89 or newer, device is {sku.arch}"
        return None

    # --- parameters --------------------------------------------------------------------------
    @classmethod
    def gemm_configs(cls, problem: MoEProblem,
                     params: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
        """The Triton configs of GEMM1 and GEMM2."""
        if cls.split:
            return config_of(params, "g1_"), config_of(params, "g2_")
        config = config_of(params)
        return config, config

    @classmethod
    def from_gemm_configs(cls, problem: MoEProblem, gemm1: dict[str, int],
                          gemm2: dict[str, int]) -> dict[str, Any] | None:
        """The two configs as they are; one config for both GEMMs only where they are equal."""
        if cls.split:
            return with_prefix(gemm1, "g1_") | with_prefix(gemm2, "g2_")
        return dict(gemm1) if gemm1 == gemm2 else None

    @classmethod
    def seed_params(cls, problem: MoEProblem, sku: SKU) -> dict[str, Any] | None:
        """vLLM's config (the CUDA rule's), so each family starts where serving is."""
        config = vllm_config(problem, sku)[0]
        return with_prefix(config, "g1_") | with_prefix(config, "g2_") if cls.split else config

    @classmethod
    def check_params(cls, problem: MoEProblem, params: dict[str, Any]) -> str | None:
        for gemm, config in zip(("GEMM1", "GEMM2"), cls.gemm_configs(problem, params)):
            reason = check_config(problem, config)
            if reason:
                return f"{gemm}: {reason}"
        return None

    # --- execution ---------------------------------------------------------------------------
    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        from moetune.runtime.kernels._align import align

        config1, config2 = cls.gemm_configs(problem, params)
        first = _first_stage(cls.gemm1, problem, weights, config1, cls.persistent)
        moe_op = aiter_loader.load("moe_op").module
        gemm2 = bind_gemm(moe_op.fused_moe, problem, weights.w2, weights.w2_scale, config2,
                          persistent=cls.persistent)
        num_experts, hidden = weights.w2.shape[0], weights.w2.shape[1]
        block_m1, block_m2 = config1["BLOCK_SIZE_M"], config2["BLOCK_SIZE_M"]
        mul_weight = not problem.router_weight_on_input

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
            m, topk = topk_ids.shape
            routing1 = align(topk_ids, block_m1, num_experts)
            routing2 = routing1 if block_m2 == block_m1 else align(topk_ids, block_m2, num_experts)
            h = first(x, topk_weights, topk_ids, routing1)
            y = x.new_empty(m, topk, hidden)
            gemm2(h, y, topk_weights, topk_ids, routing2, mul_weight, 1)
            return torch.sum(y, dim=1, out=out)

        return run


def _first_stage(gemm1: Gemm1, problem: MoEProblem, weights: MoEWeights, config: dict[str, int],
                persistent: bool) -> Stage:
    """GEMM1, then the activation as a torch op unless GEMM1 fuses it (any activation then,
    gated or not)."""
    fn = getattr(aiter_loader.load(gemm1.module).module, gemm1.function)
    gemm = bind_gemm(fn, problem, weights.w13, weights.w13_scale, config, persistent=persistent)
    width = weights.w2.shape[2] if gemm1.fused else weights.w13.shape[1]
    on_input = problem.router_weight_on_input

    def stage(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              routing: Routing) -> torch.Tensor:
        m, topk = topk_ids.shape
        h = x.new_empty((m * topk, width) if gemm1.flat else (m, topk, width))
        gemm(x, h, topk_weights, topk_ids, routing, on_input, topk)
        h = h.view(m * topk, width)
        return h if gemm1.fused else activate(h, problem)

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


_SPLIT_PARAMS = config_params("g1_") + config_params("g2_")


def _variant(name: str, gemm1: Gemm1, *, persistent: bool) -> type[AiterTritonKernel]:
    """``aiter_triton`` with a config per GEMM, ``gemm1``, and persistent launches or not, as a
    class named after ``name`` (``aiter_triton_silu_fused``: ``AiterTritonSiluFusedKernel``)."""
    doc = f"A config per GEMM; {gemm1.doc}{'; both GEMMs persistent' if persistent else ''}."
    fields: dict[str, Any] = {
        "__module__": __name__, "__doc__": doc, "name": name, "params": _SPLIT_PARAMS,
        "split": True, "gemm1": gemm1, "persistent": persistent,
        "modules": tuple(dict.fromkeys(("moe_op", gemm1.module))), **gemm1.limits}
    if persistent:  # aiter's persistent launch sizes its grid by the GPU's SM count
        fields["vendors"] = frozenset({Vendor.NVIDIA, Vendor.AMD})
    words = name.removeprefix("aiter_triton_").split("_")
    return type("AiterTriton" + "".join(w.title() for w in words) + "Kernel",
                (AiterTritonKernel,), fields)


#: The variants, by the names tables store.
AiterTritonSplitKernel = _variant("aiter_triton_split", UNFUSED, persistent=False)
AiterTritonSiluFusedKernel = _variant("aiter_triton_silu_fused", SILU_FUSED, persistent=False)
AiterTritonGeluFusedKernel = _variant("aiter_triton_gelu_fused", GELU_FUSED, persistent=False)
AiterTritonPersistentKernel = _variant("aiter_triton_persistent", UNFUSED, persistent=True)
AiterTritonSiluFusedPersistentKernel = _variant("aiter_triton_silu_fused_persistent", SILU_FUSED,
                                                persistent=True)
AiterTritonGeluFusedPersistentKernel = _variant("aiter_triton_gelu_fused_persistent", GELU_FUSED,
                                                persistent=True)
