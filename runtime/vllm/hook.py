"""Where moetune meets vLLM: the experts' ``apply``, wrapped to run a table winner per call.

vLLM 0.3x picks one experts class per layer at load (``fused_moe/oracle/unquantized.py``:
``CPUUnquantizedExperts`` on CPU, ``TritonExperts`` on CUDA, ``AiterExperts`` on ROCm) and calls
``experts.apply(output, hidden_states, w1, w2, topk_weights, topk_ids, ...)`` between its
prepare and finalize steps, which stay vLLM's. Dispatch is two-level, as DESIGN.md says:

* per layer, at load (or first call): the layer's shape, and its weights in a layout a moetune
  kernel can run. Triton keeps the plain (E, N, K) weights, so they are used as they are; vLLM's
  CPU experts prepack theirs in ``process_weights_after_loading``, so a plain copy is kept before
  that, but only for layers where some bucket's table winner is not the rule's pick (memory: one
  more copy of those experts; none where vLLM's own kernel wins every bucket).
* per call: ``plan[num_tokens]`` -> the prepared winner or None (run vLLM's own ``apply``:
  no table row, or the winner is the rule's pick, i.e. vLLM's kernel itself); filled once per
  num_tokens through the dispatcher, then a dict lookup. The choice depends on num_tokens only;
  while a CUDA graph is captured, winners that are not ``graph_safe`` give way to vLLM's kernel.
  Where Dynamo traces the experts (vLLM on the CPU), layers that run a moetune kernel for some
  num_tokens become one opaque op (``op``); the others trace vLLM's own ``apply``, as if
  moetune were not there (those calls are not counted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from moetune.runtime.kernels.base import MoEWeights
from moetune.runtime.vllm import op
from moetune.runtime.vllm.classes import (APPLY_PARAMS, LOAD_PARAMS, ExpertsSpec, IncompatibleVllm,
                                          check_method)
from moetune.runtime.vllm.describe import describe
from moetune.runtime.vllm.layer import LayerPlan, runs_moetune
from moetune.runtime.vllm.state import Mode, PluginState

logger = logging.getLogger("moetune")

_MARK = "__moetune_original__"
_PROBE = "__moetune_capturing__"
_ATTR = "_moetune_layer"


def install(state: PluginState, specs: tuple[ExpertsSpec, ...]) -> list[str]:
    """Check every class first, then wrap them; idempotent. Returns the hooked class names.

    Raises:
        IncompatibleVllm: a class, method or signature is not what vLLM 0.32 has; nothing
            has been patched then.
    """
    import importlib

    found = []
    for spec in specs:
        try:
            cls = getattr(importlib.import_module(spec.module), spec.name)
        except (ImportError, AttributeError) as e:
            raise IncompatibleVllm(f"{spec.module}.{spec.name} not found ({e})") from e
        check_method(cls, "apply", APPLY_PARAMS, _MARK)
        if spec.copy_at_load:
            check_method(cls, "process_weights_after_loading", LOAD_PARAMS, _MARK)
        found.append((cls, spec))
    capturing = _capture_probe()
    op.ensure_registered()
    for cls, spec in found:
        if not getattr(cls.__dict__["apply"], _MARK, None):
            cls.apply = _wrap_apply(cls.__dict__["apply"], spec, state, capturing)
        load = cls.__dict__.get("process_weights_after_loading")
        if spec.copy_at_load and not getattr(load, _MARK, None):
            cls.process_weights_after_loading = _wrap_load(load, spec, state)
    return [cls.__name__ for cls, _ in found]


def _capture_probe() -> Callable[[], bool]:
    """True while a CUDA graph is being captured (never on CPU)."""
    if torch.cuda.is_available():
        return torch.cuda.is_current_stream_capturing
    return _never


def _never() -> bool:
    return False


def _attach(experts: Any, spec: ExpertsSpec, state: PluginState, w13: torch.Tensor,
            w2: torch.Tensor, on_input: bool, at_load: bool) -> LayerPlan:
    """Build the layer's moetune state once; anything unexpected leaves the layer to vLLM.

    Raises:
        TableError: ``strict`` mode without a usable table (the only error that escapes).
    """
    dispatcher = state.dispatcher()
    try:
        shape, why = describe(experts, w13, w2, on_input)
    except Exception as e:  # noqa: BLE001 - e.g. an attribute vLLM renamed
        shape, why = None, f"vLLM internals differ ({type(e).__name__}: {e})"
    weights = None
    covered = shape is not None and dispatcher.covers(shape)
    runs = covered and runs_moetune(dispatcher, shape, spec.layout)
    if covered and not spec.copy_at_load:
        weights = MoEWeights(w13, w2)
    elif runs and at_load:
        weights = MoEWeights(w13.detach().clone(), w2.detach().clone())
        state.plain_copy_bytes += sum(t.numel() * t.element_size()
                                      for t in (weights.w13, weights.w2))
    apply = type(experts).apply
    layer = LayerPlan(state, shape, why, weights, spec.layout, experts,
                      getattr(apply, _MARK, apply), getattr(apply, _PROBE, _never))
    # Traced, a layer that never runs a moetune kernel is vLLM's own apply, uncounted (record
    # mode keeps the op: it must see every num_tokens to record the missed ones).
    layer.traced_op = (runs and weights is not None) or state.settings.mode is Mode.RECORD
    layer.activation = getattr(experts.moe_config, "activation", None)
    layer.op_id = op.bind(layer.run_traced)
    experts.__dict__[_ATTR] = layer
    return layer


def _wrap_load(original: Callable[..., Any], spec: ExpertsSpec,
               state: PluginState) -> Callable[..., Any]:
    def process_weights_after_loading(self: Any, layer: Any) -> None:
        _attach(self, spec, state, layer.w13_weight, layer.w2_weight,
                getattr(layer, "apply_router_weight_on_input", False), at_load=True)
        return original(self, layer)

    setattr(process_weights_after_loading, _MARK, original)
    return process_weights_after_loading


def _wrap_apply(original: Callable[..., Any], spec: ExpertsSpec, state: PluginState,
                capturing: Callable[[], bool]) -> Callable[..., Any]:
    def apply(self: Any, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: Any, global_num_experts: int, expert_map: torch.Tensor | None,
              a1q_scale: Any, a2_scale: Any, workspace13: Any, workspace2: Any,
              expert_tokens_meta: Any, apply_router_weight_on_input: bool) -> Any:
        if torch.compiler.is_compiling():  # traced (vLLM on CPU): one opaque op per layer
            layer = getattr(self, _ATTR, None)
            if (layer is None or not layer.traced_op or expert_tokens_meta is not None
                    or activation is not layer.activation):
                return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
                                activation, global_num_experts, expert_map, a1q_scale,
                                a2_scale, workspace13, workspace2, expert_tokens_meta,
                                apply_router_weight_on_input)
            torch.ops.moetune.experts_apply(
                output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map, a1q_scale,
                a2_scale, workspace13, workspace2, global_num_experts,
                apply_router_weight_on_input, layer.op_id)
            return None
        layer = self.__dict__.get(_ATTR)
        if layer is None:
            layer = _attach(self, spec, state, w1, w2, apply_router_weight_on_input, False)
        return layer.run(output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                         global_num_experts, expert_map, a1q_scale, a2_scale, workspace13,
                         workspace2, expert_tokens_meta, apply_router_weight_on_input)

    setattr(apply, _MARK, original)
    setattr(apply, _PROBE, capturing)
    return apply
