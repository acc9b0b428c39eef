"""The one check of a winner row: whether serving on a SKU uses it, and what it runs.

Serving judges the rows of a shape with it when the shape is first asked for; ``moetune show``
and ``tune --skip-tuned`` judge each row they print or skip; ``merge``, ``export`` and
``import`` share its row-level part, ``row_problem``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from moetune.db import Candidate, WinnerRecord
from moetune.errors import MoetuneError
from moetune.runtime.platform import SKU, environment_mismatches
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import Registry, default_registry
from moetune.runtime.rules import RuleChoice, rule_choice


@dataclasses.dataclass(frozen=True)
class Selection:
    """What to run for one call. ``source`` is ``table`` or ``rule``; ``reason`` says why."""

    kernel: str
    params: dict[str, Any]
    source: str
    reason: str
    bucket: int | None = None
    median_us: float | None = None
    speedup: float | None = None
    #: The kernel and params are what the rule picks for this call: the engine's own kernel,
    #: which serves it best (no copy, no wrapper), though the table chose it.
    rule_pick: bool = False


@dataclasses.dataclass(frozen=True)
class RowVerdict:
    """Whether a table row is served on a SKU: ``selection`` is what it makes serving run, or
    None, and ``reason`` says why (``other_sku``: the row is for another device)."""

    selection: Selection | None
    reason: str
    problem: MoEProblem | None = None
    other_sku: bool = False
    #: Not served only because today's rule was not among its baselines (re-tune it).
    stale: bool = False
    #: Served, but by the rule's pick: the winner did not beat today's rule.
    rule_kept: bool = False


def row_verdict(row: WinnerRecord, sku: SKU, registry: Registry = default_registry,
                environment: Mapping[str, Any] | None = None) -> RowVerdict:
    """The one check of a winner row, shared by serving, ``show`` and ``tune --skip-tuned``.

    A row is served when it is valid (``row_problem``, the part ``merge``, ``export`` and
    ``import`` share: its bucket and kernel are known and its params lie in the kernel's
    declared space) and, for measured rows, today's rule here is one of the baselines it was
    timed against: if the winner beat it the winner runs, if not the rule's pick runs. Imported
    rows won nothing here; they are the user's choice and serve as they are.

    With ``environment`` (the versions here), a measured row whose run recorded other
    torch/triton/CUDA/HIP versions is stale: its timings say nothing about the code those
    versions generate, whatever the newest run of a merged table was measured under.
    """
    if (row.sku["vendor"], row.sku["name"], row.sku["arch"]) != (sku.vendor.value, sku.name,
                                                                 sku.arch):
        return RowVerdict(None, f"for {row.sku['vendor']}:{row.sku['name']} ({row.sku['arch']}), "
                                f"this device is {sku.label()}", other_sku=True)
    problem, params, invalid = _validated(row, registry)
    if invalid is not None:
        return RowVerdict(None, invalid, problem)
    served = Selection(row.kernel, params, "table",
                       f"table winner for bucket M={problem.num_tokens}", problem.num_tokens,
                       row.median_us, row.speedup)
    if row.source != "measured":
        return RowVerdict(served, f"imported ({row.source})", problem)
    if environment is not None and row.environment is not None:
        mismatches = environment_mismatches(row.environment, environment)
        if mismatches:
            return RowVerdict(None, f"stale: measured in another environment ("
                                    f"{'; '.join(mismatches)}): re-confirm this bucket "
                                    "(tune --reconfirm)", problem, stale=True)
    rule = rule_choice(problem, sku)
    measured = next((b for b in row.baselines if b.stands_for(rule)), None)
    if measured is None:
        return RowVerdict(None, _stale_reason(row, rule), problem, stale=True)
    if Candidate(row.kernel, params) == Candidate(rule.kernel, rule.params):
        return RowVerdict(served, "the winner is today's rule's pick", problem)
    if measured.beaten:
        return RowVerdict(served, f"beat today's rule ({rule.kernel})", problem)
    kept = Selection(rule.kernel, rule.params, "table",
                     f"table: the rule's pick is as fast as any candidate at M="
                     f"{problem.num_tokens}", problem.num_tokens, measured.median_us, 1.0)
    return RowVerdict(kept, "today's rule was not beaten: the rule's pick runs", problem,
                      rule_kept=True)


def _stale_reason(row: WinnerRecord, rule: RuleChoice) -> str:
    """Why no baseline of ``row`` is ``rule``: where one ran the rule's kernel and params for
    another vLLM or configs, re-timing the winner beside today's pick settles it; otherwise
    the bucket needs a search."""
    same = next((b for b in row.baselines if b.candidate == Candidate(rule.kernel, rule.params)),
                None)
    if same is not None:
        return f"stale: {same.why_not(rule)}: re-confirm (tune --reconfirm)"
    tried = "; ".join(str(b.candidate) for b in row.baselines)
    return (f"stale: tuned against {tried or 'no baseline'}, but the rule here is "
            f"{Candidate(rule.kernel, rule.params)} ({rule.reason}): re-tune this bucket")


def row_problem(row: WinnerRecord, registry: Registry = default_registry) -> str | None:
    """Why ``row`` is invalid on any device, or None: the row-level part of ``row_verdict``.

    A row is invalid when its bucket is not a MoE problem, its kernel is unknown, or its params
    lie outside the kernel's declared space. Staleness and the SKU are serving questions this
    leaves to ``row_verdict``. ``merge``, ``export`` and ``import`` drop the rows this refuses,
    with this reason (the one ``show`` prints); rows that ``read_winners`` could not parse are
    refused before any check.
    """
    return _validated(row, registry)[2]


def row_point(row: WinnerRecord,
              registry: Registry = default_registry) -> tuple[MoEProblem, dict[str, Any]] | None:
    """The row's problem and its params as the kernel validates them today, or None where
    ``row_problem`` refuses the row."""
    problem, params, invalid = _validated(row, registry)
    return None if invalid is not None else (problem, params)


def _validated(row: WinnerRecord, registry: Registry) -> tuple[
        MoEProblem | None, dict[str, Any] | None, str | None]:
    """The row's problem and checked params, or why it has none (the problem when known)."""
    try:
        problem = MoEProblem.from_row(row.bucket)
    except (MoetuneError, KeyError, TypeError, ValueError) as e:
        return None, None, f"invalid bucket: {e}"
    try:
        kernel = registry.get(row.kernel)
    except KeyError:
        return problem, None, f"unknown kernel {row.kernel!r}"
    try:
        return problem, kernel.validate(row.params), None
    except (MoetuneError, TypeError) as e:
        return problem, None, f"invalid params: {e}"
