"""One MoE layer as moetune sees it: its shape, runnable weights and a plan per num_tokens.

``LayerPlan.run`` is the per-call path behind the hook: ``plan[num_tokens]`` (filled once per
value through the dispatcher) says whether the table's prepared winner runs or vLLM's own
``apply``; hits, misses and fallbacks are counted per layer shape. A table winner that is the
rule's own pick (the tuning baseline: what vLLM runs) is a hit served by vLLM's ``apply`` itself,
so only winners that beat vLLM's kernel run through moetune. Nothing here knows vLLM's classes:
the hook hands in the experts object and its original ``apply``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from moetune.runtime.kernels.base import MoEFn, MoEWeights, WeightLayout, params_key
from moetune.runtime.problem import MoEProblem, Shape
from moetune.runtime.vllm.state import Outcome, PluginState, shape_label

logger = logging.getLogger("moetune")


@dataclasses.dataclass
class Step:
    """What one num_tokens value runs in one layer: ``fn`` (a moetune kernel), or vLLM's own
    ``apply`` when ``fn`` is None, counted as ``kind``."""

    fn: MoEFn | None
    kind: Outcome
    counts: dict[str, int]
    key: tuple[str, str] | None = None
    graph_safe: bool = False


def runs_moetune(dispatcher: Any, shape: Shape, layout: WeightLayout) -> bool:
    """Whether some bucket of ``shape`` in the table has a winner other than the rule's pick,
    i.e. whether the layer ever runs a moetune kernel (and needs weights one can run)."""
    for m in dispatcher.buckets(shape):
        problem = shape.problem(m)
        if not dispatcher.select(problem, layout).rule_pick:
            return True
    return False


class LayerPlan:
    """One MoE layer as moetune sees it: its shape, runnable weights and per-num_tokens plan."""

    def __init__(self, state: PluginState, shape: Shape | None, why: str,
                 weights: MoEWeights | None, layout: WeightLayout, experts: Any,
                 original: Callable[..., Any], capturing: Callable[[], bool]) -> None:
        self.state, self.shape, self.weights, self.layout = state, shape, weights, layout
        self.experts, self.original, self.capturing = experts, original, capturing
        self.op_id: int | None = None  # its index in ``op`` (the traced path)
        self.traced_op = True  # traced calls go through ``op`` (else vLLM's own apply)
        self.activation: Any = None  # vLLM's activation enum, passed on for traced calls
        self.counts = state.counter(shape if shape is not None else f"not handled: {why}")
        self.plan: dict[int, Step] = {}
        self._fns: dict[tuple[str, str], MoEFn] = {}
        self._broken: set[tuple[str, str]] = set()
        state.layers += 1
        state.hook_exit()

    def decide(self, num_tokens: int) -> Step:
        """Fill ``plan[num_tokens]`` (once per value) from the dispatcher."""
        step = Step(None, Outcome.MISS, self.counts)
        if self.shape is not None:
            try:
                step = self._decide(self.shape.problem(num_tokens))
            except Exception as e:  # noqa: BLE001 - a bug here must not take serving down
                logger.warning("moetune: cannot choose a kernel for %s (%s: %s); vLLM's own "
                               "kernel runs", shape_label(self.shape), type(e).__name__, e)
        self.plan[num_tokens] = step
        return step

    def _decide(self, problem: MoEProblem) -> Step:
        dispatcher = self.state.dispatcher()
        selection = dispatcher.select(problem, self.layout)
        bucket = problem.bucket()
        if selection.source != "table":
            self.state.record_miss(problem)
            kind = Outcome.FALLBACK if dispatcher.covers(problem.shape) else Outcome.MISS
            return Step(None, kind, self.counts)
        if selection.bucket != bucket.num_tokens:
            self.state.record_miss(problem)  # a neighbour's winner runs; tune this bucket too
        if selection.rule_pick:
            return Step(None, Outcome.HIT, self.counts)  # the winner is vLLM's own kernel
        key = (selection.kernel, params_key(selection.params))
        if self.weights is None or key in self._broken:
            return Step(None, Outcome.FALLBACK, self.counts)
        kernel = dispatcher.registry.get(selection.kernel)
        fn = self._fns.get(key)
        if fn is None:
            try:
                fn = self._fns[key] = kernel.prepare(bucket, selection.params, self.weights)
            except Exception as e:  # noqa: BLE001 - a kernel that cannot bind: vLLM runs
                self._break(key, e)
                return Step(None, Outcome.FALLBACK, self.counts)
        return Step(fn, Outcome.HIT, self.counts, key, kernel.graph_safe)

    def failed(self, step: Step, error: Exception) -> None:
        """A winner raised: vLLM's kernel runs for every num_tokens that used it, from now on."""
        assert step.key is not None
        self._break(step.key, error)
        for m, s in self.plan.items():
            if s.key == step.key:
                self.plan[m] = Step(None, Outcome.FALLBACK, self.counts)

    def _break(self, key: tuple[str, str], error: Exception) -> None:
        self._broken.add(key)
        logger.warning("moetune: kernel %s %s failed on %s (%s: %s); vLLM's own kernel runs "
                       "instead", key[0], key[1],
                       shape_label(self.shape) if self.shape else "?", type(error).__name__, error)

    def run(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
            w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            activation: Any, global_num_experts: int, expert_map: torch.Tensor | None,
            a1q_scale: Any, a2_scale: Any, workspace13: Any, workspace2: Any,
            expert_tokens_meta: Any, apply_router_weight_on_input: bool) -> Any:
        """One experts call: the table's winner into ``output``, or vLLM's own ``apply``.

        A kernel that is not ``graph_safe`` never runs while a CUDA graph is being captured
        (its host sync would break the capture): vLLM's kernel is captured instead.
        """
        step = self.plan.get(hidden_states.shape[0]) or self.decide(hidden_states.shape[0])
        if step.fn is not None and expert_map is None and (step.graph_safe
                                                             or not self.capturing()):
            # vLLM's prepare step already scaled the input when the weight goes on the input.
            weights = topk_weights
            if apply_router_weight_on_input:
                weights = torch.ones_like(topk_weights)
            try:
                result = step.fn(hidden_states, weights, topk_ids)
            except Exception as e:  # noqa: BLE001 - serving goes on with vLLM's kernel
                self.failed(step, e)
            else:
                output.copy_(result)
                step.counts[Outcome.HIT.value] += 1
                return None
        kind = Outcome.FALLBACK if step.fn is not None else step.kind
        step.counts[kind.value] += 1
        return self.original(self.experts, output, hidden_states, w1, w2, topk_weights, topk_ids,
                             activation, global_num_experts, expert_map, a1q_scale, a2_scale,
                             workspace13, workspace2, expert_tokens_meta,
                             apply_router_weight_on_input)

    def run_traced(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   expert_map: torch.Tensor | None, a1q_scale: Any, a2_scale: Any,
                   workspace13: Any, workspace2: Any, global_num_experts: int,
                   apply_router_weight_on_input: bool) -> None:
        """``run`` as ``moetune::experts_apply`` calls it (the arguments a torch op can carry)."""
        self.run(output, hidden_states, w1, w2, topk_weights, topk_ids, self.activation,
                 global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                 None, apply_router_weight_on_input)
