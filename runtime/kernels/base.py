"""The kernel contract: eligibility with a reason, a declared parameter space, a weight layout,
and a prepared callable that computes the whole MoE layer exactly as serving calls it."""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib.util
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Protocol

import torch

from moetune.db import params_key as params_key  # the key tables store params by
from moetune.errors import InvalidParamsError
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import Activation, DType, MoEProblem, QuantScheme


class MoEFn(Protocol):
    """``fn(hidden_states[M, H], topk_weights[M, topk] float32, topk_ids[M, topk], out=None)
    -> out[M, H]`` in the input's dtype.

    ``out``, when given, is where the result goes (a contiguous (M, H) tensor of the input's
    dtype that aliases no input): serving passes the engine's output buffer, so no copy follows
    the kernel. The callable returns it; without it the result is a new tensor.
    """

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor: ...


def write(result: torch.Tensor, out: torch.Tensor | None,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """``result`` as a prepared callable returns it: copied into ``out`` when given (one copy
    that also casts), else cast to ``dtype``. For kernels whose last result is a new tensor."""
    if out is not None:
        return out.copy_(result)
    return result if dtype is None else result.to(dtype)


class WeightLayout(str, enum.Enum):
    """How a layer stores its expert weights. A layer holds one layout, so a table winner is
    only usable on layers whose layout matches (dispatch is layout-per-layer, kernel-per-call)."""

    PLAIN = "plain"  # w13: (E, 2I, H), w2: (E, H, I), as vLLM and Triton kernels keep them
    AITER_SHUFFLED = "aiter_shuffled"  # pre-shuffled for aiter's asm/CK kernels
    #: as vLLM's DEEPGEMM fp8 backend holds them: requantized to power-of-two block scales where
    #: DeepGEMM's E8M0 scales are in use (vLLM's default with DeepGEMM), scales in its layout
    DEEP_GEMM = "deep_gemm"
    #: w13 as [up; gate] (w31; block scales likewise, clamped to >= 1e-10), as vLLM's
    #: FLASHINFER_CUTLASS backend holds them (``prepare_fp8_moe_layer_for_fi``)
    FLASHINFER_W31 = "flashinfer_w31"


@dataclasses.dataclass
class MoEWeights:
    """Expert weights of one layer in the ``PLAIN`` layout, with scales when quantized.

    ``w13`` is (E, 2I, H) for gated layers (gate rows first, then up) and (E, I, H) otherwise;
    ``w2`` is (E, H, I). Scales follow the quant scheme: one per expert (per-tensor),
    one per output row (per-channel), or one per 128x128 block.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    quant: QuantScheme = QuantScheme.NONE
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None


class Trial(Protocol):
    """The part of ``optuna.Trial`` a kernel needs to sample its parameters (define-by-run)."""

    def suggest_categorical(self, name: str, choices: Any) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Param:
    """One tunable parameter: the values the search samples, and values also accepted when
    given (``extra``: a config another tool chose, like vLLM's tuned files, that the search
    need not explore). ``default``: for a parameter a kernel gained after tables were written,
    the value its older rows ran at, which they are served at; None: every row gives it.
    ``moves_with``: parameters the local search also moves one step along with this one, as
    (name, +1 the same way or -1 the other way): a tile grown only pays with more warps to
    compute it, which no move of one parameter at a time reaches."""

    name: str
    choices: tuple[Any, ...]
    extra: tuple[Any, ...] = ()
    default: Any = None
    moves_with: tuple[tuple[str, int], ...] = ()


class BaseKernel(abc.ABC):
    """A named MoE implementation. Subclasses are stateless: data plus predicates.

    MUST set: ``name``, ``prepare``.
    MAY set: what it runs on and what it computes, as data (the capability fields below:
    ``supports`` checks them, so a kernel declares them instead of writing checks); ``params``
    (default: none), ``layout`` (default PLAIN), ``candidate`` (False keeps a kernel out of
    tuning, like the float32 reference), ``graph_safe``, ``compiles``, ``skips_unrouted``.
    MAY override: ``_supports_device``, ``_supports_quant``, ``_supports_problem`` for what is
    not data (returning ``super()``'s verdict where theirs passes), ``check_params``
    (constraints across parameters, e.g. shared memory), ``seed_params``, ``gemm_configs`` and
    ``from_gemm_configs``, ``in_engine`` (a kernel that is the engine's own ``apply``),
    ``run_to_run`` (whether its output bits can change between calls).
    """

    name: ClassVar[str]
    layout: ClassVar[WeightLayout] = WeightLayout.PLAIN
    params: ClassVar[tuple[Param, ...]] = ()
    candidate: ClassVar[bool] = True
    #: True if the prepared callable never syncs with the host (no ``.item()``, ``.tolist()``,
    #: ``bincount``/``nonzero`` on the GPU), so it can run while a CUDA graph is captured.
    graph_safe: ClassVar[bool] = False
    #: True if the first call with new parameters compiles (Triton JIT): the tuner then runs
    #: it once ahead of timing, in parallel with other such candidates.
    compiles: ClassVar[bool] = False
    #: True if the prepared callable takes ``topk_ids`` entries of -1 (a slot routed nowhere,
    #: as vLLM's routers give the padding rows of a batch padded to a CUDA graph's size) and
    #: such a slot contributes nothing, with no extra launch: a row with no routed slot comes
    #: out zero (as vLLM's ``TritonExperts`` leaves it) and its activations are never read
    #: (they may be garbage, even not finite); every other row is exactly what it is without
    #: those slots. False: serving first sends such slots to expert 0 at weight 0 (one launch).
    skips_unrouted: ClassVar[bool] = False
    #: True if two calls on the same inputs give bitwise the same output at any parameters:
    #: checked for this family (no float atomics, or none that add more than two values into
    #: one element). False, the default: not checked; a family whose answer depends on its
    #: parameters overrides ``run_to_run`` instead.
    deterministic: ClassVar[bool] = False

    # --- capabilities ------------------------------------------------------------------------
    #: The vendors it runs on.
    vendors: ClassVar[frozenset[Vendor]] = frozenset(Vendor)
    #: The oldest NVIDIA compute capability it runs on (``SKU.sm``: 90 is sm_90); 0: any.
    min_sm: ClassVar[int] = 0
    #: The AMD archs it runs on; empty: any.
    amd_archs: ClassVar[tuple[str, ...]] = ()
    #: Optional modules that must be importable (checked without importing them).
    requires: ClassVar[tuple[str, ...]] = ()
    quants: ClassVar[frozenset[QuantScheme]] = frozenset({QuantScheme.NONE})
    dtypes: ClassVar[frozenset[DType]] = frozenset(DType)
    activations: ClassVar[frozenset[Activation]] = frozenset(Activation)
    #: True: gated (act-and-mul) layers only; False: ungated only; None: both.
    gated: ClassVar[bool | None] = None
    #: False: the router weight must apply to the output (not ``router_weight_on_input``).
    router_weight_on_input: ClassVar[bool] = True
    #: What hidden_size (H) and intermediate_size (I) must be multiples of.
    hidden_align: ClassVar[int] = 1
    intermediate_align: ClassVar[int] = 1

    # --- eligibility -------------------------------------------------------------------------
    @classmethod
    def supports(cls, problem: MoEProblem, sku: SKU) -> tuple[bool, str | None]:
        """Whether this kernel can run ``problem`` on ``sku``, and if not, why."""
        for check in (cls._supports_device, cls._supports_quant, cls._supports_problem):
            reason = check(problem, sku)
            if reason:
                return False, f"{cls.name}: {reason}"
        return True, None

    @classmethod
    def _supports_sku(cls, sku: SKU) -> str | None:
        """None if ``sku``'s hardware is one the kernel runs on (whatever is installed here)."""
        if sku.vendor not in cls.vendors:
            wanted = " or ".join(cls._vendor_label(v) for v in Vendor if v in cls.vendors)
            return f"needs {wanted}, device is {sku.label()}"
        if sku.vendor is Vendor.NVIDIA and sku.sm < cls.min_sm:
            return f"needs sm_{cls.min_sm} or newer, device is {sku.arch}"
        if sku.vendor is Vendor.AMD and cls.amd_archs and sku.arch not in cls.amd_archs:
            return f"needs {cls._vendor_label(Vendor.AMD)}, device is {sku.label()}"
        return None

    @classmethod
    def _vendor_label(cls, vendor: Vendor) -> str:
        if vendor is Vendor.NVIDIA:
            return f"an NVIDIA GPU (sm_{cls.min_sm} or newer)" if cls.min_sm else "an NVIDIA GPU"
        if vendor is Vendor.AMD:
            return f"an AMD {'/'.join(cls.amd_archs)} GPU" if cls.amd_archs else "an AMD GPU"
        return "the CPU"

    @classmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        """None if the device (and this install) can run this kernel, else the reason."""
        reason = cls._supports_sku(sku)
        if reason:
            return reason
        for module in cls.requires:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed"
        return None

    @classmethod
    def _supports_quant(cls, problem: MoEProblem, sku: SKU) -> str | None:
        if problem.quant in cls.quants:
            return None
        return (f"quant scheme {problem.quant.value} not supported "
                f"({_only(QuantScheme, cls.quants)})")

    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        if problem.dtype not in cls.dtypes:
            return f"dtype {problem.dtype.value} not supported ({_only(DType, cls.dtypes)})"
        if problem.activation not in cls.activations:
            return (f"activation {problem.activation.value} not supported "
                    f"({_only(Activation, cls.activations)})")
        if cls.gated is not None and problem.gated != cls.gated:
            return "gated (act-and-mul) layers only" if cls.gated else "ungated layers only"
        if problem.router_weight_on_input and not cls.router_weight_on_input:
            return "router weight on the input not supported (on the output only)"
        for what, size, align in (("hidden", problem.hidden_size, cls.hidden_align),
                                  ("intermediate", problem.intermediate_size,
                                   cls.intermediate_align)):
            if size % align:
                return f"{what} size {size} is not a multiple of {align}"
        return None

    @classmethod
    def run_to_run(cls, problem: MoEProblem, params: dict[str, Any]) -> str | None:
        """Why two calls with ``params`` on the same inputs may give different bits (float
        atomics add in the order the GPU runs them, and float addition is not associative),
        or None where they give the same. Serving under ``MOETUNE_DETERMINISTIC=1`` and tuning
        with ``--deterministic`` take only kernels that give None."""
        return None if cls.deterministic else f"{cls.name} is not checked for determinism"

    # --- parameters --------------------------------------------------------------------------
    @classmethod
    def space_size(cls) -> int:
        size = 1
        for p in cls.params:
            size *= len(p.choices)
        return size

    @classmethod
    def suggest(cls, trial: Trial) -> dict[str, Any]:
        """Sample parameters conditionally on this kernel (names are prefixed by the kernel)."""
        return {p.name: trial.suggest_categorical(f"{cls.name}.{p.name}", p.choices)
                for p in cls.params}

    @classmethod
    def seed_params(cls, problem: MoEProblem, sku: SKU) -> dict[str, Any] | None:
        """A known-good configuration the search measures first (None: let the sampler pick)."""
        return {} if not cls.params else None

    @classmethod
    def check_params(cls, problem: MoEProblem, params: dict[str, Any]) -> str | None:
        """None if ``params`` can run ``problem`` (e.g. fits in shared memory), else why not."""
        return None

    @classmethod
    def gemm_configs(cls, problem: MoEProblem,
                     params: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]] | None:
        """The work per program of GEMM1 and GEMM2 as vLLM-style Triton configs (GEMM1's
        ``BLOCK_SIZE_N`` spanning gate and up columns), for kernels built on that space; None
        (the default) for the others. With ``from_gemm_configs`` it lets the search start one
        family where another's best config is."""
        return None

    @classmethod
    def from_gemm_configs(cls, problem: MoEProblem, gemm1: dict[str, int],
                          gemm2: dict[str, int]) -> dict[str, Any] | None:
        """This kernel's parameters doing the work per program of ``gemm_configs``' two
        configs; None (the default) where it has no such parameters or they cannot run."""
        return None

    @classmethod
    def validate(cls, params: dict[str, Any]) -> dict[str, Any]:
        """Check stored parameters against the declared space before any use; a parameter
        with a ``default`` that they lack gets it.

        Raises:
            InvalidParamsError: unknown or missing names, or a value outside its choices.
        """
        if not isinstance(params, dict):
            raise InvalidParamsError(f"{cls.name}: params must be an object, got {params!r}")
        params = {p.name: p.default for p in cls.params if p.default is not None} | params
        why = invalid_params(cls.params, params)
        if why:
            raise InvalidParamsError(f"{cls.name}: {why}")
        return params

    @classmethod
    def searchable(cls, params: dict[str, Any]) -> bool:
        """Whether the search space holds ``params`` (valid ones may lie outside it)."""
        return all(params.get(p.name) in p.choices for p in cls.params)

    # --- execution ---------------------------------------------------------------------------
    @classmethod
    def in_engine(cls, problem: MoEProblem, params: dict[str, Any]
                  ) -> Callable[[], AbstractContextManager[None]] | None:
        """For a kernel that is the engine's own experts ``apply`` under a setting of its
        parameters (vLLM's Triton path with a config override): that setting, entered around
        each call. Serving then runs the layer's own ``apply`` inside it, where the layer is
        vLLM's ``TritonExperts``, rather than the prepared callable, which would build a second
        engine kernel and enter the hooked ``apply`` again. None (the default): serving runs
        ``prepare``'s callable."""
        return None

    @classmethod
    @abc.abstractmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        """Bind weights and parameters; the returned callable is what serving runs per call."""


def _only(kind: type[enum.Enum], members: frozenset[Any]) -> str:
    """``"float16, bfloat16 only"``: a capability field's members, in ``kind``'s order."""
    return ", ".join(m.value for m in kind if m in members) + " only"


def invalid_params(declared: tuple[Param, ...], params: dict[str, Any]) -> str | None:
    """Why ``params`` do not fit ``declared`` (unknown or missing names, a value outside its
    choices and extras), or None."""
    by_name = {p.name: p for p in declared}
    unknown = sorted(set(params) - set(by_name))
    missing = sorted(set(by_name) - set(params))
    if unknown or missing:
        return f"unknown params {unknown}, missing params {missing}"
    for name, value in params.items():
        allowed = by_name[name].choices + by_name[name].extra
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            return f"{name}={value!r} not in {list(allowed)}"
    return None
