"""``moetune::experts_apply``: the per-call choice as an opaque torch op, for traced MoE layers.

On CUDA and ROCm vLLM runs each MoE layer inside its own opaque custom op, so the hook's Python
runs eagerly even in a compiled model. On the CPU vLLM calls the layer directly and Dynamo traces
into the experts' ``apply`` (with ``fullgraph``), where dict lookups, counters and kernel
objects cannot go. There the hook calls this op instead: the compiled graph holds one opaque
call per layer, and its body (the layer's ``run_traced``, eager) picks the kernel per call.

Layers are registered weakly: the op keeps no model alive once vLLM drops it.

No ``from __future__ import annotations`` here: ``torch.library`` reads the annotations.
"""

import itertools
import threading
import weakref
from typing import Any

import torch

_LAYERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_IDS = itertools.count()
_LOCK = threading.Lock()
_REGISTERED = False


def bind(layer: Any) -> int:
    """Make ``layer.run_traced`` callable through the op while ``layer`` lives; returns its id."""
    with _LOCK:
        op_id = next(_IDS)
        _LAYERS[op_id] = layer
        return op_id


def bound(op_id: int) -> bool:
    """Whether the layer behind ``op_id`` is still alive."""
    return op_id in _LAYERS


def ensure_registered() -> None:
    """Define the op once per process (idempotent)."""
    global _REGISTERED
    with _LOCK:
        if _REGISTERED:
            return

        @torch.library.custom_op("moetune::experts_apply", mutates_args=("output",))
        def experts_apply(output: torch.Tensor, tensors: list[torch.Tensor | None],
                          ints: list[int], op_id: int) -> None:
            _LAYERS[op_id].run_traced(output, tensors, ints)

        @experts_apply.register_fake
        def _(output, tensors, ints, op_id) -> None:
            return None

        _REGISTERED = True
