"""The vLLM experts classes moetune wraps, per platform, and the weights each holds.

vLLM 0.3x picks one experts class per layer at load (``fused_moe/oracle/unquantized.py`` and
``oracle/fp8.py``: ``CPUUnquantizedExperts`` or ``CPUExpertsFp8``/``CPUExpertsFp8W8A8`` on the
CPU, ``TritonExperts`` on CUDA, ``AiterExperts`` or ``TritonExperts`` on ROCm) and calls its
``apply`` between its prepare and finalize steps. These are the only names of vLLM classes in
moetune; ``tests/test_vllm_contract.py`` checks them against the installed vLLM.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from moetune.runtime.kernels.base import WeightLayout

_EXPERTS = "vllm.model_executor.layers.fused_moe.experts."


class IncompatibleVllm(Exception):
    """vLLM's internals differ from what this package knows; the plugin disables itself."""


class Held(str, enum.Enum):
    """The weight layout vLLM's experts class holds once it has loaded a layer."""

    PLAIN = "plain"  # (E, 2I, H) and (E, H, I), as checkpoints store them
    AITER_SHUFFLED = "aiter-shuffled"  # pre-shuffled for aiter's CK/asm kernels
    CPU_PREPACKED = "CPU-prepacked"  # blocked for vLLM's C++ CPU kernels (ISA-specific)


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
    """

    module: str
    name: str
    held: Held
    copy_at_load: bool = False
    copy_at_pack: bool = False
    defers_input_quant: bool = False

    @property
    def layout(self) -> WeightLayout | None:
        """The layout moetune kernels see in this class's layers, or None if they see none."""
        if self.held is Held.AITER_SHUFFLED:
            return WeightLayout.AITER_SHUFFLED
        if self.held is Held.PLAIN or self.copy_at_load or self.copy_at_pack:
            return WeightLayout.PLAIN
        return None

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
CUDA_SPECS = (TRITON,)
ROCM_SPECS = (ExpertsSpec(_EXPERTS + "rocm_aiter_moe", "AiterExperts", Held.AITER_SHUFFLED),
              TRITON)
ALL_SPECS = CPU_SPECS + CUDA_SPECS + ROCM_SPECS[:1]
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


def platform_specs() -> tuple[ExpertsSpec, ...]:
    """The experts classes vLLM may pick on this platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return CPU_SPECS
    if current_platform.is_rocm():
        return ROCM_SPECS
    if current_platform.is_cuda():
        return CUDA_SPECS
    raise IncompatibleVllm(f"no MoE hook for platform {type(current_platform).__name__}")


#: The property vLLM's prepare step reads to leave activation quantization to ``apply``.
DEFER_PROPERTY = "expects_unquantized_inputs"


def check_property(cls: type, name: str) -> None:
    """Raise IncompatibleVllm unless ``cls`` itself defines the property ``name`` (moetune's
    wrapper is a property too)."""
    found = cls.__dict__.get(name)
    if not isinstance(found, property) or found.fget is None:
        raise IncompatibleVllm(f"{cls.__name__}.{name} is not a property of the class")


def check_method(cls: type, method: str, params: tuple[str, ...], mark: str) -> None:
    """Raise IncompatibleVllm unless ``cls`` itself defines ``method`` with exactly ``params``
    (looking through moetune's own wrapper, which keeps the original under ``mark``)."""
    fn: Callable[..., Any] | None = cls.__dict__.get(method)
    fn = getattr(fn, mark, fn)
    if fn is None or not callable(fn):
        raise IncompatibleVllm(f"{cls.__name__}.{method} is not defined on the class")
    names = tuple(inspect.signature(fn).parameters)
    if names != params:
        raise IncompatibleVllm(f"{cls.__name__}.{method}{names} differs from {params}")
