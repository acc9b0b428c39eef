"""The vLLM experts classes moetune wraps, per platform, and the methods it expects on them.

vLLM 0.3x picks one experts class per layer at load (``fused_moe/oracle/unquantized.py``:
``CPUUnquantizedExperts`` on CPU, ``TritonExperts`` on CUDA, ``AiterExperts`` on ROCm) and
calls its ``apply`` between its prepare and finalize steps. These are the only names of vLLM
classes in moetune.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from moetune.runtime.kernels.base import WeightLayout

_EXPERTS = "vllm.model_executor.layers.fused_moe.experts."

#: ``FusedMoEExpertsModular.apply``'s parameters, in order (vLLM passes them by keyword).
APPLY_PARAMS = ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids",
                "activation", "global_num_experts", "expert_map", "a1q_scale", "a2_scale",
                "workspace13", "workspace2", "expert_tokens_meta", "apply_router_weight_on_input")
LOAD_PARAMS = ("self", "layer")


class IncompatibleVllm(Exception):
    """vLLM's internals differ from what this package knows; the plugin disables itself."""


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    """One vLLM experts class moetune hooks, and what its weights look like after loading."""

    module: str
    name: str
    layout: WeightLayout
    copy_at_load: bool  # vLLM repacks the weights: keep a plain copy before it does


CPU_SPECS = (ExpertsSpec(_EXPERTS + "cpu_moe", "CPUUnquantizedExperts", WeightLayout.PLAIN, True),)
CUDA_SPECS = (ExpertsSpec(_EXPERTS + "triton_moe", "TritonExperts", WeightLayout.PLAIN, False),)
ROCM_SPECS = (ExpertsSpec(_EXPERTS + "rocm_aiter_moe", "AiterExperts",
                          WeightLayout.AITER_SHUFFLED, False),) + CUDA_SPECS


def platform_specs() -> tuple[ExpertsSpec, ...]:
    """The experts classes vLLM picks on this platform for unquantized MoE."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return CPU_SPECS
    if current_platform.is_rocm():
        return ROCM_SPECS
    if current_platform.is_cuda():
        return CUDA_SPECS
    raise IncompatibleVllm(f"no MoE hook for platform {type(current_platform).__name__}")


def check_method(cls: type, method: str, params: tuple[str, ...], mark: str) -> None:
    """Raise IncompatibleVllm unless ``cls`` defines ``method`` with exactly ``params``
    (looking through moetune's own wrapper, which keeps the original under ``mark``)."""
    fn: Callable[..., Any] | None = cls.__dict__.get(method)
    fn = getattr(fn, mark, fn)
    if fn is None or not callable(fn):
        raise IncompatibleVllm(f"{cls.__name__}.{method} is not defined on the class")
    names = tuple(inspect.signature(fn).parameters)
    if names != params:
        raise IncompatibleVllm(f"{cls.__name__}.{method}{names} differs from {params}")
