"""One MoE layer as moetune sees it: its plan, its prepared kernels and the per-call path.

``Layer.run`` is what the hook calls per MoE call: ``steps[num_tokens]`` (filled once per value
from the shared ``ShapePlan``) says whether a prepared moetune kernel runs or vLLM's own
``apply``; hits, misses and fallbacks are counted per layer shape. The kernels the plan names
are prepared when the layer attaches, so a call does no I/O, evaluates no rule and prepares
nothing. Nothing here knows vLLM's classes: the hook hands in the experts object and its
original ``apply`` (and, where vLLM picks between two kernels per call, ``delegate``); a call's
arguments travel as one tuple (``call.py``).

A winner that is vLLM's own ``apply`` under a setting (``BaseKernel.in_engine``: vLLM's Triton
path with a searched config) runs as the layer's own ``apply`` inside that setting, entered only
around the call, in layers whose ``apply`` is vLLM's ``TritonExperts`` one (``engine``); nothing
is prepared for it and no weights are needed. Where its setting raises, vLLM's ``apply`` runs the
call again without it, and from then on (a fallback, like a failed winner).

A layer that asked vLLM for unquantized activations (``quantized`` set) never hands a moetune
kernel a call that arrives quantized anyway: such a call runs vLLM's own ``apply`` as vLLM
would have run it, counted as a fallback (the layer's first call, quantized before the layer
asked, is one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch

from moetune.runtime.kernels._routes import routable
from moetune.runtime.kernels.base import MoEFn, MoEWeights
from moetune.runtime.plan import Choice, Outcome, ShapePlan
from moetune.serving.call import A1Q_SCALE, HIDDEN_STATES, ApplyCall, from_op

logger = logging.getLogger("moetune")


class Step(NamedTuple):
    """What one num_tokens value runs in one layer: ``fn`` (a moetune kernel), or vLLM's own
    ``apply`` when ``fn`` is None (inside ``around()`` where that is given), counted under
    ``counter`` (an ``Outcome`` value, held as a string: reading an enum's ``.value`` per call
    costs a few hundred nanoseconds)."""

    fn: MoEFn | None
    counter: str
    key: tuple[str, str] | None = None
    graph_safe: bool = False
    around: Callable[[], AbstractContextManager[None]] | None = None
    #: ``fn`` takes slots routed nowhere as they are (``BaseKernel.skips_unrouted``).
    skips_unrouted: bool = False


_MISS, _FALLBACK, _HIT = Outcome.MISS.value, Outcome.FALLBACK.value, Outcome.HIT.value
_DELEGATED = Outcome.DELEGATED.value
#: The activation dtypes moetune's kernels are tuned on; anything else arrived quantized.
_UNQUANTIZED = frozenset({torch.float32, torch.float16, torch.bfloat16})


class Layer:
    """One experts object's moetune state. Built once per layer by the hook.

    Args:
        label: the layer's shape as counters name it (or why moetune leaves it to vLLM).
        plan: the shape's plan, or None for a layer moetune leaves to vLLM.
        counts: the live counter dict of the layer's shape (``PluginState.counter``).
        weights: weights a moetune kernel can run, or None (every moetune choice falls back).
        misses: called with the problem of each num_tokens the table has no row for.
        engine: ``original`` is vLLM's ``TritonExperts.apply``, which the settings of
            ``in_engine`` kernels change (elsewhere such a winner falls back).

    Set by the hook after construction: ``quantized``, vLLM's own ``apply`` (of the call's
    arguments) for a call whose activations arrive quantized although the layer made vLLM's
    prepare step leave them unquantized (None: it did not); ``delegate``, in a layer whose
    vLLM class picks one of two kernels per call: runs the call on vLLM's pick and returns True
    when that is not the kernel the plan serves, else returns False and runs nothing.
    """

    def __init__(self, label: str, plan: ShapePlan | None, counts: dict[str, int],
                 weights: MoEWeights | None, experts: Any, original: Callable[..., Any],
                 capturing: Callable[[], bool], misses: Callable[[Any], None],
                 engine: bool = False) -> None:
        self.label, self.plan, self.counts, self.weights = label, plan, counts, weights
        self.experts, self.original, self.capturing = experts, original, capturing
        self._misses = misses
        self.steps: dict[int, Step] = {}
        self.fns: dict[tuple[str, str], MoEFn] = {}
        #: The settings of vLLM's own ``apply`` the plan's ``in_engine`` winners run under.
        self.engine_settings: dict[tuple[str, str], Callable[[], AbstractContextManager[None]]] = {}
        self.traced_op = False  # traced calls go through ``op`` (else vLLM's own apply)
        self.op_id: int | None = None  # its id in ``op`` (the traced path)
        self.activation: Any = None  # vLLM's activation enum, passed on for traced calls
        self.quantized: Callable[[tuple[Any, ...]], Any] | None = None
        self.delegate: Callable[[tuple[Any, ...]], bool] | None = None
        #: Calls may carry padding rows (vLLM 0.34's ``PaddedStandard``): ``unpadded``.
        self.padded = False
        #: Calls may carry rows routed nowhere (a batch padded to a CUDA graph): ``routable``.
        self.unrouted = False
        if plan is not None and weights is not None:
            self._prepare(plan, weights)
        if plan is not None and engine:
            self._engine_settings(plan)

    def _prepare(self, plan: ShapePlan, weights: MoEWeights) -> None:
        for key, (m, choice) in plan.kernels().items():
            try:
                self.fns[key] = plan.registry.get(key[0]).prepare(
                    plan.shape.problem(m), choice.params, weights)
            except Exception as e:  # noqa: BLE001 - a kernel that cannot bind: vLLM runs
                self._warn(key, "cannot be prepared", e)

    def _engine_settings(self, plan: ShapePlan) -> None:
        for key, (m, choice) in plan.kernels(engine=True).items():
            try:
                setting = plan.registry.get(key[0]).in_engine(plan.shape.problem(m),
                                                              choice.params)
            except Exception as e:  # noqa: BLE001 - vLLM runs as configured
                self._warn(key, "cannot be set up", e)
                continue
            if setting is not None:
                self.engine_settings[key] = setting

    def step(self, num_tokens: int) -> Step:
        """Fill ``steps[num_tokens]`` (once per value) from the plan."""
        if self.plan is None:
            step = Step(None, _MISS)
        else:
            choice, missed = self.plan.lookup(num_tokens)
            if missed is not None:
                self._misses(self.plan.shape.problem(missed))
            step = self._step(choice)
        self.steps[num_tokens] = step
        return step

    def _step(self, choice: Choice) -> Step:
        if choice.key is None:
            return Step(None, choice.outcome.value)
        if choice.engine:
            setting = self.engine_settings.get(choice.key)
            return (Step(None, _FALLBACK) if setting is None else
                    Step(None, _HIT, choice.key, True, setting))
        fn = self.fns.get(choice.key)
        if fn is None:  # no runnable weights here, or the kernel failed
            return Step(None, _FALLBACK)
        assert self.plan is not None  # a layer with prepared kernels has a plan
        skips = self.plan.registry.get(choice.key[0]).skips_unrouted
        return Step(fn, _HIT, choice.key, choice.graph_safe, skips_unrouted=skips)

    def run(self, args: tuple[Any, ...]) -> Any:
        """One experts call (``args``: ``ApplyCall``'s fields): the table's winner into
        ``output``, or vLLM's own ``apply`` (which, like the winner, writes ``output`` and
        returns nothing)."""
        hidden_states = args[HIDDEN_STATES]
        if self.quantized is not None and (args[A1Q_SCALE] is not None
                                           or hidden_states.dtype not in _UNQUANTIZED):
            self.counts[_FALLBACK] += 1  # no moetune kernel was tuned on these
            return self.quantized(args)
        if self.delegate is not None and self.delegate(args):
            self.counts[_DELEGATED] += 1
            return None
        num_tokens = hidden_states.shape[0]
        step = self.steps.get(num_tokens) or self.step(num_tokens)
        if step.around is not None:
            return self._in_engine(step, args)
        if step.fn is None:
            self.counts[step.counter] += 1
        elif self._ran(step, ApplyCall(*args)):
            return None
        else:
            self.counts[_FALLBACK] += 1
        return self.original(self.experts, *args)

    def _in_engine(self, step: Step, args: tuple[Any, ...]) -> Any:
        """vLLM's own ``apply`` inside the winner's setting, entered only around it (vLLM's
        apply takes any call its layer gets: quantized, padded, during a capture). If it
        raises, vLLM's ``apply`` runs the call as configured, and every later one too."""
        assert step.around is not None
        try:
            with step.around():
                result = self.original(self.experts, *args)
        except Exception as e:  # noqa: BLE001 - serving goes on with vLLM's configs
            self.failed(step, e)
            self.counts[_FALLBACK] += 1
            return self.original(self.experts, *args)
        self.counts[_HIT] += 1
        return result

    def _ran(self, step: Step, call: ApplyCall) -> bool:
        """Run the winner, which writes into ``call.output`` itself; False where vLLM's kernel
        must run instead (it then overwrites whatever a failed winner wrote there).

        A kernel that is not ``graph_safe`` never runs while a CUDA graph is being captured
        (its host sync would break the capture): vLLM's kernel is captured instead. Nor does one
        run on activations vLLM quantized: none was tuned on them. Slots routed nowhere (padding
        rows) reach a kernel that ``skips_unrouted`` as they are; others get them made routable.
        """
        if call.expert_map is not None or not (step.graph_safe or not self.capturing()):
            return False
        if call.a1q_scale is not None or call.hidden_states.dtype not in _UNQUANTIZED:
            return False  # quantized by vLLM (``run`` catches this first where it asked not to)
        # vLLM's prepare step already scaled the input when the weight is on the input.
        hidden, weights, ids = call.hidden_states, call.topk_weights, call.topk_ids
        if call.apply_router_weight_on_input:
            weights = torch.ones_like(weights)
        if step.skips_unrouted:
            pass  # the kernel takes slots routed nowhere as they are: no extra launch
        elif self.padded:
            hidden, weights, ids = unpadded(hidden, weights, ids)
        elif self.unrouted:
            weights, ids = routable(weights, ids)
        try:
            step.fn(hidden, weights, ids, out=call.output)
        except Exception as e:  # noqa: BLE001 - serving goes on with vLLM's kernel
            self.failed(step, e)
            return False
        self.counts[_HIT] += 1
        return True

    def run_traced(self, output: torch.Tensor, tensors: list[torch.Tensor | None],
                   ints: list[int]) -> None:
        """``run`` as ``moetune::experts_apply`` calls it (see ``call.op_args``)."""
        self.run(from_op(self.activation, output, tensors, ints))

    def failed(self, step: Step, error: Exception) -> None:
        """A winner raised: vLLM's kernel runs for every num_tokens that used it, from now on."""
        assert step.key is not None
        self.fns.pop(step.key, None)
        self.engine_settings.pop(step.key, None)
        self._warn(step.key, "failed", error)
        for m, s in self.steps.items():
            if s.key == step.key:
                self.steps[m] = Step(None, _FALLBACK)

    def _warn(self, key: tuple[str, str], what: str, error: Exception) -> None:
        logger.warning("moetune: kernel %s %s %s on %s (%s: %s); vLLM's own kernel runs instead",
                       key[0], key[1], what, self.label, type(error).__name__, error)


def unpadded(hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A call with padding rows as moetune's kernels can run it, giving what vLLM's
    ``TritonExperts`` gives (zeros in those rows, the routed rows untouched): every slot
    without a route (``topk_ids`` -1) goes to expert 0 with weight 0, and the activations of
    rows without any route (garbage, possibly not finite) become zeros."""
    routed = ids >= 0
    hidden = hidden.masked_fill(~routed.any(dim=1, keepdim=True), 0)
    return hidden, weights.masked_fill(~routed, 0), ids.clamp(min=0)
