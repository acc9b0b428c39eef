"""One call of a vLLM experts class's ``apply``: its arguments bound once, by name.

The signature of ``FusedMoEExpertsModular.apply`` is written here and nowhere else, as the
fields of ``ApplyCall``. The hook checks the real classes against ``APPLY_PARAMS`` before
patching; ``wrap`` makes the replacement ``apply``, which binds each call once into the tuple
of its arguments in field order (``args``); everything after it hands that tuple on whole, to
vLLM's own ``apply`` too. The per-call path reads only ``args[HIDDEN_STATES]`` (and, in layers
that take their activations unquantized, ``args[A1Q_SCALE]``; in ``FallbackExperts`` layers
``args[W1]`` and ``args[W2]`` for vLLM's pick); paths that read more name the arguments with
``ApplyCall(*args)`` (making a NamedTuple per call would cost about as much as the rest of the
hook).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch


class ApplyCall(NamedTuple):
    """The arguments of one ``apply`` call (without ``self``), as vLLM 0.32 declares them."""

    output: torch.Tensor
    hidden_states: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    activation: Any  # vLLM's MoEActivation
    global_num_experts: int
    expert_map: torch.Tensor | None
    a1q_scale: torch.Tensor | None
    a2_scale: torch.Tensor | None
    workspace13: torch.Tensor | None
    workspace2: torch.Tensor | None
    expert_tokens_meta: Any  # vLLM's ExpertTokensMetadata or None
    apply_router_weight_on_input: bool


APPLY_PARAMS = ("self", *ApplyCall._fields)
HIDDEN_STATES = ApplyCall._fields.index("hidden_states")
W1, W2 = ApplyCall._fields.index("w1"), ApplyCall._fields.index("w2")
A1Q_SCALE = ApplyCall._fields.index("a1q_scale")
#: ``process_weights_after_loading``'s parameters.
LOAD_PARAMS = ("self", "layer")

#: What ``moetune::experts_apply`` carries besides ``output`` (written): these tensors (None
#: allowed) and ints; ``activation`` is the layer's own and ``expert_tokens_meta`` None there.
OP_TENSORS = ("hidden_states", "w1", "w2", "topk_weights", "topk_ids", "expert_map",
              "a1q_scale", "a2_scale", "workspace13", "workspace2")
OP_INTS = ("global_num_experts", "apply_router_weight_on_input")


def wrap(original: Callable[..., Any],
         body: Callable[[Any, tuple[Any, ...]], Any]) -> Callable[..., Any]:
    """A function with ``original``'s parameters that calls ``body(self, args)``.

    Generated from the fields (as ``dataclasses`` generates ``__init__``): Python then binds
    each call, by keyword as vLLM passes it or by position, as it binds any call, where
    ``inspect.Signature.bind`` or a ``**kwargs`` wrapper would cost microseconds per MoE call.

    Raises:
        ValueError: ``original``'s parameters are not ``APPLY_PARAMS``.
    """
    found = tuple(inspect.signature(original).parameters)
    if found != APPLY_PARAMS:
        raise ValueError(f"{original.__qualname__}{found} differs from {APPLY_PARAMS}")
    fields = ", ".join(ApplyCall._fields)
    namespace = {"body": body}
    exec(f"def apply(self, {fields}):\n"  # noqa: S102 - code made from the fields above only
         f"    return body(self, ({fields},))\n", namespace)
    apply = namespace["apply"]
    apply.__qualname__ = getattr(original, "__qualname__", apply.__qualname__)
    apply.__doc__ = original.__doc__
    return apply


def op_args(call: ApplyCall) -> tuple[torch.Tensor, list[torch.Tensor | None], list[int]]:
    """``output``, tensors and ints as ``moetune::experts_apply`` takes them."""
    return (call.output, [getattr(call, n) for n in OP_TENSORS],
            [int(getattr(call, n)) for n in OP_INTS])


def from_op(activation: Any, output: torch.Tensor, tensors: list[torch.Tensor | None],
            ints: list[int]) -> ApplyCall:
    """The call ``op_args`` came from (``activation``: the layer's own)."""
    return ApplyCall(output=output, activation=activation, expert_tokens_meta=None,
                     global_num_experts=ints[0], apply_router_weight_on_input=bool(ints[1]),
                     **dict(zip(OP_TENSORS, tensors)))
