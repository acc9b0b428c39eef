"""The vLLM experts classes moetune wraps, per platform, and the weights each holds.

vLLM 0.3x picks one experts class per layer at load (``fused_moe/oracle/unquantized.py`` and
``oracle/fp8.py``: ``CPUUnquantizedExperts`` or ``CPUExpertsFp8``/``CPUExpertsFp8W8A8`` on the
CPU, ``TritonExperts`` or ``TritonOrDeepGemmExperts`` on CUDA, ``AiterExperts`` or
``TritonExperts`` on ROCm) and calls its ``apply`` between its prepare and finalize steps. These
are the only names of vLLM classes in moetune; ``tests/test_vllm_contract.py`` and
``tests/test_vllm_fallback_experts.py`` check them against the installed vLLM.

``TritonOrDeepGemmExperts`` (the fp8 oracle's DEEPGEMM backend: block-fp8 layers on CUDA when
DeepGEMM is asked for, ``VLLM_USE_DEEP_GEMM``/``VLLM_MOE_USE_DEEP_GEMM`` set to 1 or
``--moe-backend deep_gemm``, or when no backend the oracle ranks before it fits, as under expert
parallelism on Hopper without FlashInfer; under tensor parallelism on Hopper the oracle ranks
``TritonExperts`` first) is a
``FallbackExperts``: it holds a ``DeepGemmExperts`` (``experts``) and a ``TritonExperts``
(``fallback_experts``), and its ``apply`` runs the one ``_select_experts_impl`` picks per call.
moetune's plan stands in for the Triton one only (``ExpertsSpec.serves``); DeepGEMM's calls stay
vLLM's.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from moetune.runtime.vllm.versions import VllmFacts, installed_facts

_EXPERTS = "vllm.model_executor.layers.fused_moe.experts."


class IncompatibleVllm(Exception):
    """vLLM's internals differ from what this package knows; the plugin disables itself."""


class Held(str, enum.Enum):
    """The weight layout vLLM's experts class holds once it has loaded a layer."""

    PLAIN = "plain"  # (E, 2I, H) and (E, H, I), as checkpoints store them
    AITER_SHUFFLED = "aiter-shuffled"  # pre-shuffled for aiter's CK/asm kernels
    CPU_PREPACKED = "CPU-prepacked"  # blocked for vLLM's C++ CPU kernels (ISA-specific)
    #: requantized to power-of-two block scales for DeepGEMM (and, on Blackwell, the scales
    #: packed as UE8M0 integers): ``ExpertsSpec.deep_gemm``
    DEEP_GEMM_E8M0 = "DeepGEMM-requantized (E8M0 scales)"


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    """One vLLM experts class moetune hooks, and the weights it holds after loading.

    ``copy_at_load``: vLLM repacks the weights in the class's ``process_weights_after_loading``,
    so a plain copy is kept before it does (for layers that run a moetune kernel).
    ``copy_at_pack``: vLLM's fp8 method packs them before the experts object exists
    (``prepack.FUNCTION``); a plain copy is kept there (``prepack``), likewise.
    ``defers_input_quant``: the class quantizes the activations itself in ``apply`` when its
    ``expects_unquantized_inputs`` property says so (vLLM's prepare step then hands them over
    unquantized). For fp8 layers that run a moetune kernel the hook makes it say so: moetune's
    kernels then get the activations as they were tuned, and vLLM's own kernel, where it
    runs, quantizes them exactly as its prepare step would have.
    ``serves``: the class is a ``FallbackExperts`` (``FALLBACK``); this attribute of it holds the
    experts object (a ``TritonExperts``) whose calls, as vLLM's own pick hands them over, the
    plan serves. vLLM's other kernel (DeepGEMM) runs the rest of the calls as vLLM picked them.
    ``deep_gemm``: vLLM's DeepGEMM backend prepared the layer's weights at load (``oracle/fp8.py``
    ``convert_to_fp8_moe_kernel_format``, through ``prepare_fp8_moe_layer_for_deepgemm``). It
    leaves them as the checkpoint holds them (plain 128 x 128 block fp8, float32 scales) unless
    DeepGEMM's E8M0 scales are in use (``is_deep_gemm_e8m0_used``; on by default wherever
    DeepGEMM runs, ``VLLM_USE_DEEP_GEMM_E8M0=0`` turns it off): it then requantizes them to
    power-of-two scales (packed as UE8M0 integers on Blackwell), and ``_select_experts_impl``
    picks DeepGEMM for every call, so no moetune kernel has a call to serve (``holds``).
    """

    module: str
    name: str
    held: Held
    copy_at_load: bool = False
    copy_at_pack: bool = False
    defers_input_quant: bool = False
    serves: str | None = None
    deep_gemm: bool = False
    inherits_apply: bool = False

    @property
    def apply_inherited(self) -> bool:
        """``apply`` may come from a base class: a ``FallbackExperts`` (``serves``) or one of
        the per-scheme aiter classes vLLM 0.33 split off ``AiterExperts``."""
        return self.serves is not None or self.inherits_apply

    @property
    def triton_apply(self) -> bool:
        """The calls the plan serves reach vLLM's ``TritonExperts.apply`` (this class's own, or
        a ``FallbackExperts``'s Triton one): what vLLM's config override changes."""
        return self.name == "TritonExperts" or self.serves is not None

    @property
    def kernels_see(self) -> Held | None:
        """The weights moetune kernels see in this class's layers (``PLAIN`` where a plain copy
        is kept), or None if they see none."""
        if self.held is Held.AITER_SHUFFLED:
            return Held.AITER_SHUFFLED
        if self.held is Held.PLAIN or self.copy_at_load or self.copy_at_pack:
            return Held.PLAIN
        return None

    def holds(self) -> tuple[Held, str]:
        """What this class's layers hold in this process, and why moetune leaves them to vLLM
        whatever the table says ("" when it does not)."""
        if self.deep_gemm and deep_gemm_e8m0():
            return Held.DEEP_GEMM_E8M0, (
                "DeepGEMM E8M0 scales are in use (VLLM_USE_DEEP_GEMM_E8M0): vLLM requantized "
                "the weights for DeepGEMM and runs DeepGEMM for every call")
        return self.held, ""

    def load(self) -> type:
        """The class itself. Raises: IncompatibleVllm if vLLM has no such class."""
        try:
            return getattr(importlib.import_module(self.module), self.name)
        except (ImportError, AttributeError) as e:
            raise IncompatibleVllm(f"{self.module}.{self.name} not found ({e})") from e


CPU_SPECS = (
    ExpertsSpec(_EXPERTS + "cpu_moe", "CPUUnquantizedExperts", Held.CPU_PREPACKED, True),
    # fp8 weights are packed by the quant method before the experts object exists; W8A16's
    # packing (``prepack``) is where a plain copy is kept, W8A8's repacks scales too (none kept).
    ExpertsSpec(_EXPERTS + "cpu_moe", "CPUExpertsFp8", Held.CPU_PREPACKED, copy_at_pack=True),
    ExpertsSpec(_EXPERTS + "cpu_moe", "CPUExpertsFp8W8A8", Held.CPU_PREPACKED),
)
TRITON = ExpertsSpec(_EXPERTS + "triton_moe", "TritonExperts", Held.PLAIN,
                     defers_input_quant=True)
FALLBACK = ExpertsSpec(_EXPERTS + "triton_deep_gemm_moe", "TritonOrDeepGemmExperts", Held.PLAIN,
                       defers_input_quant=True, serves="fallback_experts", deep_gemm=True)
CUDA_SPECS = (TRITON, FALLBACK)
#: The DeepGEMM half of ``FALLBACK``, which moetune runs as a kernel of its own (``deepgemm``),
#: never hooks: its weights are what vLLM's DEEPGEMM backend prepared (requantized under E8M0).
DEEP_GEMM = ExpertsSpec(_EXPERTS + "deep_gemm_moe", "DeepGemmExperts", Held.DEEP_GEMM_E8M0)


def aiter_specs(facts: VllmFacts) -> tuple[ExpertsSpec, ...]:
    """vLLM's ROCm aiter experts classes in the version of ``facts`` (their weights shuffled
    for aiter's CK/asm kernels)."""
    split = facts.aiter_experts != ("AiterExperts",)
    return tuple(ExpertsSpec(_EXPERTS + "rocm_aiter_moe", name, Held.AITER_SHUFFLED,
                             inherits_apply=split) for name in facts.aiter_experts)


def rocm_specs(facts: VllmFacts) -> tuple[ExpertsSpec, ...]:
    return aiter_specs(facts) + (TRITON,)


def all_specs(facts: VllmFacts) -> tuple[ExpertsSpec, ...]:
    """Every class the plugin hooks on some platform in the version of ``facts``."""
    return CPU_SPECS + CUDA_SPECS + aiter_specs(facts)
#: vLLM's unquantized CPU experts in the order its oracle tries them, the portable one last:
#: the ISA-specific ones subclass ``CPUUnquantizedExperts`` and inherit its hooked methods.
CPU_UNQUANTIZED = ("X86CPUUnquantizedExperts", "ArmCPUUnquantizedExperts",
                   "PowerCPUUnquantizedExperts", "CPUUnquantizedExperts")


def cpu_experts(*names: str) -> tuple[type, ...]:
    """Classes of vLLM's CPU experts module, by name (``CPU_UNQUANTIZED``, a ``CPU_SPECS`` name).

    Raises:
        IncompatibleVllm: vLLM has no such class.
    """
    return tuple(ExpertsSpec(_EXPERTS + "cpu_moe", n, Held.CPU_PREPACKED).load() for n in names)


def deep_gemm_e8m0() -> bool:
    """vLLM's own answer to whether DeepGEMM's E8M0 scales are in use in this process (cached
    by vLLM; False wherever DeepGEMM cannot run)."""
    from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used

    return bool(is_deep_gemm_e8m0_used())


def platform_specs() -> tuple[ExpertsSpec, ...]:
    """The experts classes vLLM may pick on this platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return CPU_SPECS
    if current_platform.is_rocm():
        return rocm_specs(installed_facts())
    if current_platform.is_cuda():
        return CUDA_SPECS
    raise IncompatibleVllm(f"no MoE hook for platform {type(current_platform).__name__}")


#: The property vLLM's prepare step reads to leave activation quantization to ``apply``.
DEFER_PROPERTY = "expects_unquantized_inputs"
#: ``FallbackExperts`` (``experts/fallback.py``): ``apply`` calls
#: ``self._select_experts_impl(hidden_states, w1, w2)`` and runs the ``apply`` of what it returns,
#: ``self.experts`` or ``self.fallback_experts``.
SELECT = "_select_experts_impl"
SELECT_PARAMS = ("self", "hidden_states", "w1", "w2")


def own(cls: type, name: str, inherited: bool = False) -> Any:
    """``cls``'s attribute ``name`` as the class holds it (no descriptor bound): its own, or
    with ``inherited`` the one its method resolution order finds (None if there is none)."""
    if not inherited:
        return cls.__dict__.get(name)
    return next((c.__dict__[name] for c in cls.__mro__ if name in c.__dict__), None)


def check_property(cls: type, name: str, inherited: bool = False) -> None:
    """Raise IncompatibleVllm unless ``cls`` itself (or, ``inherited``, a base of it) defines the
    property ``name`` (moetune's wrapper is a property too)."""
    found = own(cls, name, inherited)
    if not isinstance(found, property) or found.fget is None:
        raise IncompatibleVllm(f"{cls.__name__}.{name} is not a property of the class")


def check_fallback(cls: type, triton: type) -> None:
    """Raise IncompatibleVllm unless ``cls`` picks per call as ``FallbackExperts`` does
    (``SELECT`` defined on the class itself) between two classes, the fallback one ``triton``.

    ``get_clses`` is vLLM's own declaration of the pair (its ``_supports_*`` checks read it).
    """
    check_method(cls, SELECT, SELECT_PARAMS, "")
    try:
        pair = tuple(cls.get_clses())
    except Exception as e:  # noqa: BLE001 - any failure means the class is not what we know
        raise IncompatibleVllm(f"{cls.__name__}.get_clses() failed ({e})") from e
    if len(pair) != 2 or pair[1] is not triton:
        raise IncompatibleVllm(f"{cls.__name__} falls back to {pair[1:]}, not {triton.__name__}")


def check_method(cls: type, method: str, params: tuple[str, ...], mark: str,
                 inherited: bool = False) -> None:
    """Raise IncompatibleVllm unless ``cls`` itself (or, ``inherited``, a base of it) defines
    ``method`` with exactly ``params`` (looking through moetune's own wrapper, which keeps the
    original under ``mark``)."""
    fn: Callable[..., Any] | None = own(cls, method, inherited)
    fn = getattr(fn, mark, fn) if mark else fn
    if fn is None or not callable(fn):
        raise IncompatibleVllm(f"{cls.__name__}.{method} is not defined on the class")
    names = tuple(inspect.signature(fn).parameters)
    if names != params:
        raise IncompatibleVllm(f"{cls.__name__}.{method}{names} differs from {params}")
