"""The kernel contract: eligibility with a reason, a declared parameter space, a weight layout,
and a prepared callable that computes the whole MoE layer exactly as serving calls it."""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, Callable, ClassVar, Protocol

import torch

from moetune.db import dump_json
from moetune.errors import InvalidParamsError
from moetune.runtime.platform import SKU
from moetune.runtime.problem import MoEProblem, QuantScheme

#: ``fn(hidden_states[M, H], topk_weights[M, topk] float32, topk_ids[M, topk]) -> out[M, H]``.
MoEFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class WeightLayout(str, enum.Enum):
    """How a layer stores its expert weights. A layer holds one layout, so a table winner is
    only usable on layers whose layout matches (dispatch is layout-per-layer, kernel-per-call)."""

    PLAIN = "plain"  # w13: (E, 2I, H), w2: (E, H, I), as vLLM and Triton kernels keep them
    AITER_SHUFFLED = "aiter_shuffled"  # pre-shuffled for aiter's asm/CK kernels


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
    need not explore)."""

    name: str
    choices: tuple[Any, ...]
    extra: tuple[Any, ...] = ()


class BaseKernel(abc.ABC):
    """A named MoE implementation. Subclasses are stateless: data plus predicates.

    MUST override: ``name``, ``_supports_device``, ``prepare``.
    MAY override: ``params`` (default: none), ``layout`` (default PLAIN), ``_supports_quant``
    (default: unquantized only), ``_supports_problem`` (shape limits), ``check_params``
    (constraints across parameters, e.g. shared memory), ``candidate`` (False keeps a kernel out
    of tuning, like the float32 reference), ``graph_safe``, ``compiles``.
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
    @abc.abstractmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        """None if the device can run this kernel, else the reason it cannot."""

    @classmethod
    def _supports_quant(cls, problem: MoEProblem, sku: SKU) -> str | None:
        if problem.quant is QuantScheme.NONE:
            return None
        return f"quant scheme {problem.quant.value} not supported"

    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        return None

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
    def validate(cls, params: dict[str, Any]) -> dict[str, Any]:
        """Check stored parameters against the declared space before any use.

        Raises:
            InvalidParamsError: unknown or missing names, or a value outside its choices.
        """
        if not isinstance(params, dict):
            raise InvalidParamsError(f"{cls.name}: params must be an object, got {params!r}")
        why = invalid_params(cls.params, params)
        if why:
            raise InvalidParamsError(f"{cls.name}: {why}")
        return dict(params)

    @classmethod
    def searchable(cls, params: dict[str, Any]) -> bool:
        """Whether the search space holds ``params`` (valid ones may lie outside it)."""
        return all(params.get(p.name) in p.choices for p in cls.params)

    # --- execution ---------------------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        """Bind weights and parameters; the returned callable is what serving runs per call."""


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


def params_key(params: dict[str, Any]) -> str:
    """Canonical JSON of a parameter set, as tables store it (``db.dump_json``): the identity
    used for de-duplication and storage."""
    return dump_json(params)

