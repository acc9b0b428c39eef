"""Plain copies of the fp8 expert weights vLLM VNNI-packs for its CPU kernel.

vLLM's fp8 MoE methods pack a layer's fp8 weights for ``CPUExpertsFp8`` through
``cpu_moe.prepare_fp8_moe_layer_for_cpu(w13, w2)`` (from ``oracle/fp8.py``
``convert_to_fp8_moe_kernel_format``) before the experts object exists, so the hook on ``apply``
only ever sees packed weights. Wrapping that function keeps a plain copy of a layer whose sizes
the table has a moetune kernel for, tagged on the packed w13 (vLLM's ``replace_parameter``
carries a tensor's attributes over to the layer's parameter, as it does its own
``is_shuffled``). The hook takes the copy off when the layer attaches and keeps it only if the
layer's plan runs a moetune kernel; a layer whose description the table does not cover drops it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from moetune.errors import TableError
from moetune.runtime.vllm.classes import IncompatibleVllm, check_method

logger = logging.getLogger("moetune")

MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
FUNCTION = "prepare_fp8_moe_layer_for_cpu"
PARAMS = ("w13", "w2")
_MARK = "__moetune_original__"
_PLAIN = "_moetune_plain"

#: ``wanted(experts, hidden, intermediate)``: whether the table runs a moetune kernel on some
#: block-fp8 shape of these sizes (the rest of the shape is known only once the layer attaches).
Wanted = Callable[[int, int, int], bool]


def check() -> None:
    """Raises: IncompatibleVllm if vLLM has no ``FUNCTION`` taking exactly ``PARAMS``."""
    check_method(_module(), FUNCTION, PARAMS, _MARK)  # type: ignore[arg-type] # a module's dict


def install(wanted: Wanted) -> None:
    """Wrap vLLM's CPU fp8 packing once (idempotent); ``check`` it first."""
    module = _module()
    original = getattr(module, FUNCTION)
    if getattr(original, _MARK, None) is None:
        setattr(module, FUNCTION, _wrap(original, wanted))


def _module() -> Any:
    try:
        return importlib.import_module(MODULE)
    except ImportError as e:
        raise IncompatibleVllm(f"{MODULE} not found ({e})") from e


def take_plain(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The plain (w13, w2) kept for the layer whose packed w13 this is, removed from it."""
    return w13.__dict__.pop(_PLAIN, None)


def _wrap(original: Callable[..., Any], wanted: Wanted) -> Callable[..., Any]:
    def prepare_fp8_moe_layer_for_cpu(w13: torch.Tensor,
                                      w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        plain = None
        try:
            keep = wanted(w13.shape[0], w13.shape[2], w2.shape[2])
        except TableError:
            raise  # strict mode refuses to load without a usable table
        except Exception as e:  # noqa: BLE001 - a bug here must not stop vLLM loading
            logger.warning("moetune: cannot tell whether an fp8 layer %s needs plain weights "
                           "(%s: %s); vLLM's own kernel serves it", tuple(w13.shape),
                           type(e).__name__, e)
            keep = False
        if keep:
            # Copied before packing: the packing op's schema marks its input as written.
            plain = (w13.detach().clone(), w2.detach().clone())
        packed13, packed2 = original(w13, w2)
        if plain is not None:
            setattr(packed13, _PLAIN, plain)
        return packed13, packed2

    setattr(prepare_fp8_moe_layer_for_cpu, _MARK, original)
    return prepare_fp8_moe_layer_for_cpu

