"""What a layer shape runs at each num_tokens, decided once when its first layer attaches.

A ``ShapePlan`` holds, for one (shape, weight layout), the choice of every bucket the table has
for that shape: a moetune kernel (a winner that beats vLLM's pick), vLLM's own ``apply`` (the
winner is the rule's pick: a hit), vLLM's own ``apply`` under a winner's setting (a kernel that
is vLLM's own with other parameters, ``BaseKernel.in_engine``: a hit), or vLLM's own as a
fallback (the winner cannot run on this layout, or the table's row for that bucket is faulty).
It asks the dispatcher once per bucket at attach time, so serving never evaluates the rule;
``lookup`` maps a num_tokens to the nearest of those buckets (as the dispatcher does), memoized.
Layers of the same shape and layout share one plan (``PluginState.plan``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from moetune.runtime.kernels.base import BaseKernel, WeightLayout, params_key
from moetune.runtime.problem import MoEProblem, Shape, bucket_of, nearest
from moetune.runtime.registry import Registry


class Outcome(str, enum.Enum):
    """What one MoE call ran. Counted per layer shape."""

    HIT = "hit"  # the table's winner ran (vLLM's own kernel, when that is the winner)
    MISS = "miss"  # no table row for this shape (or no usable table): vLLM's own kernel ran
    FALLBACK = "fallback"  # the table had a winner that cannot run here: vLLM's kernel ran
    #: vLLM's own per-call pick (``TritonOrDeepGemmExperts``) ran its other kernel, DeepGEMM,
    #: which the table does not time: no table gap to record (not a miss) and no winner that
    #: failed to run (not a fallback). Counted only in the layers that pick.
    DELEGATED = "delegated"


@dataclasses.dataclass(frozen=True)
class Choice:
    """What calls mapped to one bucket run: ``kernel`` with ``params`` (moetune's), or vLLM's own
    ``apply`` when ``kernel`` is None, or (``engine``) vLLM's own ``apply`` inside ``kernel``'s
    setting of ``params``; counted as ``outcome``; ``reason`` says why."""

    outcome: Outcome
    reason: str
    kernel: str | None = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    graph_safe: bool = False
    #: ``stale``, ``faulty`` or ``nondeterministic`` where the bucket has a table row serving
    #: does not use.
    refused: str = ""
    #: ``kernel`` is vLLM's own ``apply`` under a setting (``BaseKernel.in_engine``).
    engine: bool = False

    @property
    def key(self) -> tuple[str, str] | None:
        """(kernel, canonical params): the identity of a prepared moetune kernel."""
        return None if self.kernel is None else (self.kernel, params_key(self.params))

    def label(self) -> str:
        if self.kernel is not None:
            return f"{self.kernel} (vLLM's apply)" if self.engine else self.kernel
        if self.outcome is Outcome.HIT:
            return "vLLM"
        return f"vLLM ({self.outcome.value}: {self.refused} row)" if self.refused else (
            f"vLLM ({self.outcome.value})")


_MISS = Choice(Outcome.MISS, "shape not in table")


def nondeterministic(kernel: type[BaseKernel], problem: MoEProblem,
                     params: dict[str, Any]) -> str | None:
    """Why serving under ``MOETUNE_DETERMINISTIC=1`` refuses ``kernel`` with ``params`` at
    ``problem`` (its bits may change between calls: ``BaseKernel.run_to_run``), or None: the
    one check and wording of ``ShapePlan.build`` and ``moetune show``. The rule's pick is
    vLLM's own kernel, served whatever this says."""
    varies = kernel.run_to_run(problem, params)
    return (f"MOETUNE_DETERMINISTIC=1, and the winner's bits may change between calls: {varies}"
            if varies else None)


class ShapePlan:
    """The per-bucket choices of one (shape, layout). Thread safety: ``lookup`` fills a memo
    (a benign race: two threads compute the same value)."""

    def __init__(self, shape: Shape, layout: WeightLayout, choices: Mapping[int, Choice],
                 tuned: frozenset[int], registry: Registry) -> None:
        self.shape, self.layout, self.registry = shape, layout, registry
        self.choices = dict(sorted(choices.items()))
        self._points = tuple(self.choices)
        self._tuned = tuned  # buckets whose row is served (not faulty)
        self._memo: dict[int, tuple[Choice, int | None]] = {}

    @classmethod
    def build(cls, dispatcher: Any, shape: Shape, layout: WeightLayout,
              deterministic: bool = False) -> ShapePlan:
        """Ask ``dispatcher`` for each of the shape's buckets. A bucket whose row the dispatcher
        refuses (faulty, or stale: timed against another rule or under other versions), or
        with ``deterministic`` one whose winner's bits may change between calls
        (``BaseKernel.run_to_run``), runs vLLM's own kernel, counted as a fallback: its
        num_tokens are not sent to a neighbour's winner, which was never timed there."""
        faults = dispatcher.faults(shape)
        choices = {m: Choice(Outcome.FALLBACK, f"faulty table row: {why}", refused="faulty")
                   if m in faults else Choice(Outcome.FALLBACK, f"table row {why}",
                                              refused="stale")
                   for m, why in dispatcher.refused(shape).items()}
        tuned = dispatcher.buckets(shape)
        for m in tuned:
            selection = dispatcher.select(shape.problem(m), layout)
            if selection.source != "table":
                choices[m] = Choice(Outcome.FALLBACK, selection.reason)
            elif selection.rule_pick:
                choices[m] = Choice(Outcome.HIT, "the winner is vLLM's own kernel")
            else:
                kernel = dispatcher.registry.get(selection.kernel)
                varies = (nondeterministic(kernel, shape.problem(m), selection.params)
                          if deterministic else None)
                if varies:
                    choices[m] = Choice(Outcome.FALLBACK, varies, refused="nondeterministic")
                    continue
                engine = kernel.in_engine(shape.problem(m), selection.params) is not None
                reason = selection.reason + (
                    "; served as vLLM's own experts apply with these parameters "
                    f"({kernel.name}.in_engine)" if engine else "")
                choices[m] = Choice(Outcome.HIT, reason, selection.kernel, selection.params,
                                    kernel.graph_safe, engine=engine)
        return cls(shape, layout, choices, frozenset(tuned), dispatcher.registry)

    @property
    def runs_moetune(self) -> bool:
        """Whether some bucket runs a moetune kernel of its own (the layer then needs runnable
        weights); a setting of vLLM's own ``apply`` (``engine``) needs none."""
        return any(c.kernel is not None and not c.engine for c in self.choices.values())

    def kernels(self, engine: bool = False) -> dict[tuple[str, str], tuple[int, Choice]]:
        """Each distinct moetune kernel of the plan (with ``engine``: each setting of vLLM's
        own ``apply`` instead), with the first bucket that runs it."""
        found: dict[tuple[str, str], tuple[int, Choice]] = {}
        for m, choice in self.choices.items():
            if choice.key is not None and choice.engine == engine:
                found.setdefault(choice.key, (m, choice))
        return found

    def bucket(self, num_tokens: int) -> int | None:
        """The bucket whose choice ``num_tokens`` gets (None: the plan has none)."""
        return nearest(num_tokens, self._points) if self._points else None

    def lookup(self, num_tokens: int) -> tuple[Choice, int | None]:
        """The choice for ``num_tokens`` (its nearest bucket in the table), and its own bucket
        when the table has no served row for it (``record`` mode tunes those), else None."""
        hit = self._memo.get(num_tokens)
        if hit is None:
            own = bucket_of(num_tokens)
            choice = self.choices[nearest(num_tokens, self._points)] if self._points else _MISS
            hit = self._memo[num_tokens] = (choice, None if own in self._tuned else own)
        return hit

    def summary(self) -> str:
        """One line: each bucket and what runs there."""
        if not self.choices:
            return "no table rows (vLLM's own kernel)"
        text = ", ".join(f"M={m} {c.label()}" for m, c in self.choices.items())
        refused = [c for c in self.choices.values() if c.refused]
        if refused:
            text += f" ({len(refused)} of {len(self.choices)} rows not served; first: "
            text += f"{refused[0].reason})"
        return text
