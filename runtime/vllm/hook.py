"""Where moetune meets vLLM: the experts' ``apply``, wrapped to run a table winner per call.

vLLM calls ``experts.apply(output=..., hidden_states=..., w1=..., ...)`` between its prepare
and finalize steps, which stay vLLM's. Dispatch is two-level, as DESIGN.md says:

* per layer, at load (or first call), ``_attach``: the layer's shape (``describe``), the plan
  of its (shape, layout) (``PluginState.plan``, shared by layers alike), and weights in a
  layout a moetune kernel can run, with the plan's kernels prepared on them. Triton keeps plain
  (E, N, K) weights, so they are used as they are; vLLM's CPU experts prepack theirs in
  ``process_weights_after_loading``, so a plain copy is kept before that, but only for layers
  whose plan runs a moetune kernel somewhere (none where vLLM's own kernel wins every bucket).
* fp8 layers of a class that quantizes activations itself when asked (``TritonExperts``:
  ``ExpertsSpec.defers_input_quant``) and that run a moetune kernel somewhere are asked to,
  from their second call on (vLLM's prepare step quantized the first one before the layer was
  attached; vLLM's kernel runs it): moetune's kernels then get unquantized activations, as they
  were tuned, and vLLM's own ``apply`` quantizes them as its prepare step would have.
* per call, ``Layer.run``: one memoized dict lookup by num_tokens -> the prepared winner, or
  vLLM's own ``apply``. While a CUDA graph is captured, winners that are not ``graph_safe``
  give way to vLLM's kernel. Where Dynamo traces the experts (vLLM on the CPU), layers that run
  a moetune kernel for some num_tokens become one opaque op (``op``); the others trace vLLM's
  own ``apply``, as if moetune were not there (those calls are not counted).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from moetune.runtime.kernels.base import WeightLayout
from moetune.runtime.problem import QuantScheme
from moetune.runtime.vllm import op, prepack
from moetune.runtime.vllm.call import APPLY_PARAMS, LOAD_PARAMS, ApplyCall, op_args, wrap
from moetune.runtime.vllm.classes import DEFER_PROPERTY, ExpertsSpec, check_method, check_property
from moetune.runtime.vllm.describe import describe, layer_weights
from moetune.runtime.vllm.layer import Layer
from moetune.runtime.vllm.settings import Mode, Outcome
from moetune.runtime.vllm.state import PluginState, shape_label

logger = logging.getLogger("moetune")

_MARK = "__moetune_original__"
_PROBE = "__moetune_capturing__"
_ATTR = "_moetune_layer"
_DEFER = "_moetune_defers_input_quant"  # True: the layer's activations reach apply unquantized


def install(state: PluginState, specs: tuple[ExpertsSpec, ...]) -> list[str]:
    """Check every class first, then wrap them; idempotent. Returns the hooked class names.

    Raises:
        IncompatibleVllm: a class, method or signature is not what this package knows;
            nothing has been patched then.
    """
    found = []
    for spec in specs:
        cls = spec.load()
        check_method(cls, "apply", APPLY_PARAMS, _MARK)
        if spec.copy_at_load:
            check_method(cls, "process_weights_after_loading", LOAD_PARAMS, _MARK)
        if spec.copy_at_pack:
            prepack.check()
        if spec.defers_input_quant:
            check_property(cls, DEFER_PROPERTY)
        found.append((cls, spec))
    capturing = _capture_probe()
    op.ensure_registered()
    if any(spec.copy_at_pack for _, spec in found):
        prepack.install(_plain_fp8_wanted(state))
    for cls, spec in found:
        if not getattr(cls.__dict__["apply"], _MARK, None):
            cls.apply = _wrap_apply(cls, spec, state, capturing)
        load = cls.__dict__.get("process_weights_after_loading")
        if spec.copy_at_load and not getattr(load, _MARK, None):
            cls.process_weights_after_loading = _wrap_load(cls, spec, state)
        defer = cls.__dict__.get(DEFER_PROPERTY)
        if spec.defers_input_quant and not getattr(defer.fget, _MARK, None):
            setattr(cls, DEFER_PROPERTY, _wrap_defer(defer))
    return [cls.__name__ for cls, _ in found]


def _plain_fp8_wanted(state: PluginState) -> prepack.Wanted:
    """Whether the table runs a moetune kernel on some block-fp8 shape of a layer's sizes:
    its plain copy is then worth keeping while vLLM packs the weights."""
    def wanted(experts: int, hidden: int, intermediate: int) -> bool:
        return any((s.num_experts, s.hidden_size, s.intermediate_size, s.quant)
                   == (experts, hidden, intermediate, QuantScheme.FP8_BLOCK_128X128)
                   and state.plan(s, WeightLayout.PLAIN).runs_moetune
                   for s in state.dispatcher().shapes())

    return wanted


def original(cls: type, method: str = "apply") -> Callable[..., Any]:
    """vLLM's own ``method`` of a hooked class (the method itself if not hooked)."""
    fn = cls.__dict__[method]
    return getattr(fn, _MARK, fn)


def _wrap_defer(original: property) -> property:
    """``expects_unquantized_inputs`` answering True for the layers the hook switched
    (``_DEFER``), vLLM's own answer for every other."""
    vllm_answer = original.fget
    assert vllm_answer is not None  # check_property

    def expects_unquantized_inputs(self: Any) -> bool:
        return self.__dict__.get(_DEFER) is True or vllm_answer(self)

    setattr(expects_unquantized_inputs, _MARK, vllm_answer)
    return property(expects_unquantized_inputs, doc=original.__doc__)


def _capture_probe() -> Callable[[], bool]:
    """True while a CUDA graph is being captured (never on CPU)."""
    if torch.cuda.is_available():
        return torch.cuda.is_current_stream_capturing
    return _never


def _never() -> bool:
    return False


def _attach(experts: Any, cls: type, spec: ExpertsSpec, state: PluginState, w13: torch.Tensor,
            w2: torch.Tensor, on_input: bool, at_load: bool) -> Layer:
    """Build the layer's moetune state once; anything unexpected leaves the layer to vLLM.

    ``cls`` is the hooked class (``experts`` may be of a subclass that inherits its methods).

    Raises:
        TableError: ``strict`` mode without a usable table (the only error that escapes).
    """
    state.dispatcher()  # strict mode refuses here, whatever the layer is
    plain = prepack.take_plain(w13) if spec.copy_at_pack else None
    if plain is not None:
        w13, w2 = plain  # what vLLM packed: describe, and run on, the plain fp8 weights
    try:
        shape, why = describe(experts, w13, w2, on_input, spec.defers_input_quant)
    except Exception as e:  # noqa: BLE001 - e.g. an attribute vLLM renamed
        shape, why = None, f"vLLM internals differ ({type(e).__name__}: {e})"
    # A class whose weights no moetune kernel can read still gets its plan's hits and misses.
    plan = None if shape is None else state.plan(shape, spec.layout or WeightLayout.PLAIN)
    weights, copied = None, False
    if plan is not None and plan.runs_moetune and spec.layout is not None:
        if spec.copy_at_load and at_load:  # before vLLM repacks them
            w13, w2, copied = w13.detach().clone(), w2.detach().clone(), True
        elif spec.copy_at_pack:  # kept while vLLM packed them
            copied = plain is not None
        if copied or not (spec.copy_at_load or spec.copy_at_pack):
            weights = layer_weights(experts, shape, w13, w2, spec.defers_input_quant)
        if copied:
            state.plain_copy_bytes += sum(t.numel() * t.element_size() for t in (w13, w2))
    label = shape_label(shape) if shape is not None else f"not handled: {why}"
    apply = cls.__dict__["apply"]
    layer = Layer(label, plan, state.counter(label), weights, experts,
                  getattr(apply, _MARK, apply), getattr(apply, _PROBE, _never), state.record_miss)
    # Traced, a layer that never runs a moetune kernel is vLLM's own apply, uncounted (record
    # mode keeps the op: it must see every num_tokens to record the missed ones).
    layer.traced_op = bool(layer.fns) or state.settings.mode is Mode.RECORD
    layer.activation = experts.moe_config.activation if shape is not None else None
    layer.op_id = op.bind(layer)
    if (spec.defers_input_quant and weights is not None and experts.quant_config.quant_dtype
            is not None and not experts.expects_unquantized_inputs):
        experts.__dict__[_DEFER] = False  # from the next call on (``_wrap_apply``)
    experts.__dict__[_ATTR] = layer
    state.layers += 1
    state.hook_exit()
    _announce(state, spec, label, layer, copied, _DEFER in experts.__dict__)
    return layer


def _announce(state: PluginState, spec: ExpertsSpec, label: str, layer: Layer,
              copied: bool, defers: bool) -> None:
    """The startup line of each distinct (shape, weight layout): what vLLM holds, what moetune
    kernels run on, and what each bucket runs."""
    if layer.weights is not None:
        runs_on = "moetune kernels run on a plain copy" if copied else "moetune kernels use them"
        if defers:
            runs_on += " with unquantized activations (vLLM's kernel quantizes its own)"
    elif layer.plan is not None and layer.plan.runs_moetune:
        runs_on = "no moetune kernel can run on them (those buckets fall back)"
    else:
        runs_on = "vLLM's own kernel serves every bucket (no copy kept)"
    plan = layer.plan.summary() if layer.plan is not None else "vLLM's own kernel"
    state.announce((label, spec.name, spec.held.value, runs_on),
                   "moetune: %s layers %s: vLLM holds %s weights, %s; %s (pid %d)", spec.name,
                   label, spec.held.value, runs_on, plan, os.getpid())


def _wrap_load(cls: type, spec: ExpertsSpec, state: PluginState) -> Callable[..., Any]:
    original = cls.__dict__["process_weights_after_loading"]

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        _attach(self, cls, spec, state, layer.w13_weight, layer.w2_weight,
                getattr(layer, "apply_router_weight_on_input", False), at_load=True)
        return original(self, layer)

    setattr(process_weights_after_loading, _MARK, original)
    return process_weights_after_loading


def _wrap_apply(cls: type, spec: ExpertsSpec, state: PluginState,
                capturing: Callable[[], bool]) -> Callable[..., Any]:
    original = cls.__dict__["apply"]
    compiling = torch.compiler.is_compiling

    def body(self: Any, args: tuple[Any, ...]) -> Any:
        if compiling():  # traced (vLLM on CPU): one opaque op per layer
            layer, call = getattr(self, _ATTR, None), ApplyCall(*args)
            if (layer is None or not layer.traced_op or call.expert_tokens_meta is not None
                    or call.activation is not layer.activation):
                return original(self, *args)
            torch.ops.moetune.experts_apply(*op_args(call), layer.op_id)
            return None
        layer = self.__dict__.get(_ATTR)
        if layer is None:
            call = ApplyCall(*args)
            layer = _attach(self, cls, spec, state, call.w1, call.w2,
                            call.apply_router_weight_on_input, False)
            if self.__dict__.get(_DEFER) is False:  # quantized by vLLM before the switch
                layer.counts[Outcome.FALLBACK.value] += 1
                result = original(self, *args)
                self.__dict__[_DEFER] = True
                return result
        return layer.run(args)

    apply = wrap(original, body)
    setattr(apply, _MARK, original)
    setattr(apply, _PROBE, capturing)
    return apply
