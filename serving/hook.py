"""Where moetune meets vLLM: the experts' ``apply``, wrapped to run a table winner per call.

vLLM calls ``experts.apply(output=..., hidden_states=..., w1=..., ...)`` between its prepare
and finalize steps, which stay vLLM's. Dispatch is two-level, as DESIGN.md says:

* per layer, at load (or first call), ``_attach``: the layer's shape (``describe``), the plan
  of its (shape, layout) (``PluginState.plan``, shared by layers alike), and weights in a
  layout a moetune kernel can run, with the plan's kernels prepared on them. Triton keeps plain
  (E, N, K) weights, so they are used as they are; vLLM's CPU experts prepack theirs in
  ``process_weights_after_loading``, so a plain copy is kept before that, but only for layers
  whose plan runs a moetune kernel somewhere (none where vLLM's own kernel wins every bucket).
* fp8 layers of a class whose activations the prepare step can be made to leave unquantized
  (``ExpertsSpec.defers_input_quant``: ``TritonExperts``, ``TritonOrDeepGemmExperts``) and that
  run a moetune kernel somewhere are switched to that when they attach: moetune's kernels then
  get unquantized activations, as they were tuned, and vLLM's own kernels get them quantized
  exactly as its prepare step would have (``TritonExperts.apply`` quantizes them itself; for
  ``TritonOrDeepGemmExperts`` the hook does, with vLLM's function, ``quant.quantize_input``).
  The layer's first call, quantized before it attached, and any call that arrives quantized
  anyway, runs vLLM's own ``apply`` as vLLM would have run it (``Layer.quantized``).
* ``TritonOrDeepGemmExperts`` (``ExpertsSpec.serves``): vLLM's own pick
  (``_select_experts_impl``, called as its ``apply`` calls it) decides per call; the plan serves
  the calls it gives the Triton fallback, the others run on DeepGEMM, counted as delegated. The
  inner ``TritonExperts`` is marked owned by the outer layer: it attaches no layer of its own
  and counts nothing.
* per call, ``Layer.run``: one memoized dict lookup by num_tokens -> the prepared winner, or
  vLLM's own ``apply`` (vLLM's pick, or a ``vllm_triton_tuned`` winner: the same ``apply`` of
  ``TritonExperts`` layers, called directly, never through this hook again, inside vLLM's
  ``override_config`` of the winner's config: ``Layer(engine=...)``). While a CUDA graph is
  captured, winners that are not ``graph_safe`` give way to vLLM's kernel. Where Dynamo traces
  the experts (vLLM on the CPU), layers that run a moetune kernel for some num_tokens become one
  opaque op (``op``); the others trace vLLM's own ``apply``, as if moetune were not there (those
  calls are not counted).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from moetune.runtime.kernels.base import WeightLayout
from moetune.runtime.problem import QuantScheme
from moetune.runtime.vllm import versions
from moetune.runtime.vllm.classes import (DEFER_PROPERTY, TRITON, ExpertsSpec, Held,
                                          check_fallback, check_method, check_property, own)
from moetune.serving import op, prepack
from moetune.serving.call import (APPLY_PARAMS, HIDDEN_STATES, LOAD_PARAMS, W1, W2, ApplyCall,
                                  op_args, wrap)
from moetune.serving.describe import describe, differs, layer_weights, padded
from moetune.serving.layer import Layer
from moetune.serving.quant import quantize_input
from moetune.serving.settings import Mode
from moetune.serving.state import PluginState, shape_label

logger = logging.getLogger("moetune")

_MARK = "__moetune_original__"
_PROBE = "__moetune_capturing__"
_ATTR = "_moetune_layer"
_DEFER = "_moetune_defers_input_quant"  # True: the layer's activations reach apply unquantized
_OWNED = "_moetune_owned"  # True: the Triton fallback of a hooked TritonOrDeepGemmExperts layer
#: The layout a moetune kernel runs on, for the weights it sees in a class's layers.
_LAYOUTS = {Held.PLAIN: WeightLayout.PLAIN, Held.AITER_SHUFFLED: WeightLayout.AITER_SHUFFLED}


def install(state: PluginState, specs: tuple[ExpertsSpec, ...]) -> list[str]:
    """Check every class first, then wrap them; idempotent. Returns the hooked class names.

    Raises:
        IncompatibleVllm: a class, method or signature is not what this package knows;
            nothing has been patched then.
    """
    found = []
    for spec in specs:
        cls = spec.load()
        picks = spec.serves is not None  # FallbackExperts: apply and the property are inherited
        check_method(cls, "apply", APPLY_PARAMS, _MARK, inherited=spec.apply_inherited)
        if picks:
            check_fallback(cls, TRITON.load())
        if spec.copy_at_load:
            check_method(cls, "process_weights_after_loading", LOAD_PARAMS, _MARK)
        if spec.copy_at_pack:
            prepack.check()
        if spec.defers_input_quant:
            check_property(cls, DEFER_PROPERTY, inherited=picks)
        found.append((cls, spec))
    capturing = _capture_probe()
    op.ensure_registered()
    if any(spec.copy_at_pack for _, spec in found):
        prepack.install(_plain_fp8_wanted(state))
    for cls, spec in found:  # a class that inherits apply gets a wrapper of its own, not its base
        if not getattr(cls.__dict__.get("apply"), _MARK, None):
            cls.apply = _wrap_apply(cls, spec, state, capturing)
        load = cls.__dict__.get("process_weights_after_loading")
        if spec.copy_at_load and not getattr(load, _MARK, None):
            cls.process_weights_after_loading = _wrap_load(cls, spec, state)
        defer = own(cls, DEFER_PROPERTY, inherited=True)
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
    """vLLM's own ``method`` of a hooked class (the method itself if not hooked; a base's if the
    class inherits it)."""
    fn = own(cls, method, inherited=True)
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
    held, not_ours = spec.holds()
    served = None if spec.serves is None else getattr(experts, spec.serves, None)
    if spec.serves is not None and served is None:
        not_ours = f"vLLM internals differ (no {spec.serves})"
    try:
        not_ours = not_ours or differs(experts, cls, w13, w2, state.vllm)
        shape, why = (None, not_ours) if not_ours else describe(
            experts, w13, w2, on_input, spec.defers_input_quant)
        pads = shape is not None and padded(experts, state.vllm)
        unrouted = shape is not None and versions.unrouted_rows(state.vllm)
    except Exception as e:  # noqa: BLE001 - e.g. an attribute vLLM renamed
        shape, why = None, f"vLLM internals differ ({type(e).__name__}: {e})"
        pads = unrouted = False
    # A class whose weights no moetune kernel can read still gets its plan's hits and misses.
    layout = _LAYOUTS.get(spec.kernels_see)
    plan = None if shape is None else state.plan(shape, layout or WeightLayout.PLAIN)
    weights, copied = None, False
    if plan is not None and plan.runs_moetune and layout is not None:
        if spec.copy_at_load and at_load:  # before vLLM repacks them
            w13, w2, copied = w13.detach().clone(), w2.detach().clone(), True
        elif spec.copy_at_pack:  # kept while vLLM packed them
            copied = plain is not None
        if copied or not (spec.copy_at_load or spec.copy_at_pack):
            weights = layer_weights(experts, shape, w13, w2, spec.defers_input_quant)
        if copied:
            state.plain_copy_bytes += sum(t.numel() * t.element_size() for t in (w13, w2))
    label = shape_label(shape) if shape is not None else f"not handled: {why}"
    apply = original(cls)
    layer = Layer(label, plan, state.counter(label, delegates=served is not None), weights,
                  experts, apply, getattr(own(cls, "apply", inherited=True), _PROBE, _never),
                  state.record_miss, engine=spec.triton_apply)
    # Traced, a layer that never runs a moetune kernel is vLLM's own apply, uncounted (record
    # mode keeps the op: it must see every num_tokens to record the missed ones).
    layer.traced_op = (bool(layer.fns) or bool(layer.engine_settings)
                       or state.settings.mode is Mode.RECORD)
    layer.padded = pads
    layer.unrouted = unrouted
    layer.activation = experts.moe_config.activation if shape is not None else None
    layer.op_id = op.bind(layer)
    defers = (spec.defers_input_quant and weights is not None and experts.quant_config.quant_dtype
              is not None and not experts.expects_unquantized_inputs)
    if defers:  # vLLM's prepare step leaves the activations alone from the next call on
        experts.__dict__[_DEFER] = True
        layer.quantized = _undeferred(experts, apply)
    if served is not None:
        _serve_fallback(layer, experts, served, defers)
    experts.__dict__[_ATTR] = layer
    state.layers += 1
    state.hook_exit()
    _announce(state, spec, held, label, layer, copied, defers)
    return layer


def _undeferred(experts: Any, apply: Callable[..., Any]) -> Callable[[tuple[Any, ...]], Any]:
    """vLLM's own ``apply`` for a call that arrived quantized although the layer asked for its
    activations unquantized, run as vLLM would have run it without the switch (switched off
    for that call: vLLM's forward runs one MoE call of a layer at a time)."""
    def run(args: tuple[Any, ...]) -> Any:
        experts.__dict__[_DEFER] = False
        try:
            return apply(experts, *args)
        finally:
            experts.__dict__[_DEFER] = True

    return run


def _serve_fallback(layer: Layer, experts: Any, served: Any, defers: bool) -> None:
    """Make ``layer`` of a ``TritonOrDeepGemmExperts`` serve only the calls vLLM's own pick
    gives its Triton fallback (``served``), as ``FallbackExperts.apply`` would run them.

    vLLM's kernels get exactly what its prepare step would have given them. Where the layer
    ``defers`` (its own ``expects_unquantized_inputs`` switched, which is what the prepare step
    reads: the inner object's is never consulted), the hook quantizes for them with vLLM's
    function, for DeepGEMM's calls and for the plan's buckets that run vLLM's Triton kernel
    alike: one place, the prepare step's arguments, and the inner ``TritonExperts`` stays as vLLM
    built it. The plan's moetune kernels get the activations unquantized, as they were tuned.
    vLLM's pick reads the activations' rows and contiguity, not their dtype, so on unquantized
    activations it picks as on the quantized ones (but for a non-contiguous tensor, which the
    quantizer would have made contiguous: it then goes to Triton, the same result).
    """
    served.__dict__[_OWNED] = True  # vLLM's own apply, should vLLM's outer apply call it
    triton = original(type(served))
    quant_config = experts.quant_config

    def vllm_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not defers:
            return args
        a1q, a1q_scale = quantize_input(quant_config, args[HIDDEN_STATES])
        return ApplyCall(*args)._replace(hidden_states=a1q, a1q_scale=a1q_scale)

    def triton_kernel(_: Any, *args: Any) -> Any:
        return triton(served, *vllm_args(args))

    def delegate(args: tuple[Any, ...]) -> bool:
        picked = experts._select_experts_impl(args[HIDDEN_STATES], args[W1], args[W2])
        if picked is served:
            return False
        picked.apply(*vllm_args(args))
        return True

    layer.original, layer.delegate = triton_kernel, delegate


def _announce(state: PluginState, spec: ExpertsSpec, held: Held, label: str, layer: Layer,
              copied: bool, defers: bool) -> None:
    """The startup line of each distinct (shape, weight layout): what vLLM holds, what moetune
    kernels run on, and what each bucket runs."""
    if layer.weights is not None:
        runs_on = "moetune kernels run on a plain copy" if copied else "moetune kernels use them"
        if defers:
            runs_on += (" with unquantized activations (vLLM's kernels get them quantized as "
                        "its prepare step would)")
    elif layer.plan is not None and layer.plan.runs_moetune:
        runs_on = "no moetune kernel can run on them (those buckets fall back)"
    elif layer.engine_settings:
        runs_on = ("vLLM's own kernel serves every bucket, some with a tuned config "
                   "(no copy kept)")
    else:
        runs_on = "vLLM's own kernel serves every bucket (no copy kept)"
    if layer.delegate is not None:
        runs_on += "; the calls vLLM gives DeepGEMM run there (counted as delegated)"
    plan = layer.plan.summary() if layer.plan is not None else "vLLM's own kernel"
    state.announce((label, spec.name, held.value, runs_on),
                   "moetune: %s layers %s: vLLM holds %s weights, %s; %s (pid %d)", spec.name,
                   label, held.value, runs_on, plan, os.getpid())


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
    original = own(cls, "apply", inherited=spec.apply_inherited)
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
            if self.__dict__.get(_OWNED):  # run for its TritonOrDeepGemmExperts, which counts
                return original(self, *args)
            call = ApplyCall(*args)
            layer = _attach(self, cls, spec, state, call.w1, call.w2,
                            call.apply_router_weight_on_input, False)
        return layer.run(args)

    apply = wrap(original, body)
    setattr(apply, _MARK, original)
    setattr(apply, _PROBE, capturing)
    return apply
