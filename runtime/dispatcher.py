"""The dispatcher: a table read once into memory, then a dict lookup per MoE call.

``select(problem)`` returns the table's winner for the problem's bucket when the table is valid
for this device and has a usable row for that shape, else the rule-based pick with the reason.
Nothing here touches the database after ``load``; nothing here raises because of a table.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from pathlib import Path
from typing import Any

from moetune.db import TableSnapshot, WinnerRecord, read_winners
from moetune.errors import MoetuneError
from moetune.runtime.kernels.base import WeightLayout, params_key
from moetune.runtime.platform import SKU, environment, environment_mismatches
from moetune.runtime.problem import MoEProblem, Shape, nearest
from moetune.runtime.registry import Registry, default_registry
from moetune.runtime.rules import is_rule_pick, rule_choice

logger = logging.getLogger("moetune")

TABLES_DIR = Path(__file__).resolve().parent / "tables"


def shipped_table(sku: SKU) -> Path:
    """Where the table shipped for ``sku`` lives: ``runtime/tables/<vendor>_<name>.db``."""
    return TABLES_DIR / f"{sku.vendor.value}_{sku.name}.db"


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
class TableStatus:
    """How loading went: what a startup log line and ``moetune lookup`` report."""

    path: str | None
    usable: bool
    reason: str
    rows: int = 0
    rejected_rows: tuple[str, ...] = ()
    #: The rejected rows of this SKU that are broken (invalid bucket, unknown kernel, invalid
    #: or unreadable params), not merely stale: serving warns about each, ``strict`` refuses.
    faulty_rows: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Entry:
    num_tokens: int
    selection: Selection


class Dispatcher:
    """Maps MoE problems to kernels. Build with ``load``; ``select`` is safe on the hot path.

    Thread safety: ``select`` only reads the loaded map and fills a memo dict (a benign race:
    two threads compute the same value).
    """

    def __init__(self, sku: SKU, status: TableStatus, entries: dict[Shape, list[_Entry]],
                 registry: Registry = default_registry,
                 faults: dict[Shape, dict[int, str]] | None = None,
                 stale: dict[Shape, dict[int, str]] | None = None) -> None:
        self.sku = sku
        self.status = status
        self.registry = registry
        self._entries = entries
        self._faults = faults or {}
        stale = stale or {}
        # Every bucket whose row is not served (faulty or stale), so a miss can say why.
        self._refused = {shape: {**stale.get(shape, {}), **self._faults.get(shape, {})}
                         for shape in {*self._faults, *stale}}
        self._points = {shape: [e.num_tokens for e in rows] for shape, rows in entries.items()}
        self._memo: dict[MoEProblem, Selection] = {}

    @classmethod
    def load(cls, path: str | Path | None, sku: SKU, *, registry: Registry = default_registry,
             check_environment: bool = True) -> Dispatcher:
        """Read ``path`` once. Any problem with the table leaves a dispatcher that uses the rules.

        The reason is in ``status`` (and logged once); ``strict`` callers check ``status.usable``.
        """
        if path is None:
            return cls(sku, TableStatus(None, False, "no table configured"), {}, registry)
        try:
            snapshot = read_winners(path)
        except (MoetuneError, OSError) as e:
            return cls(sku, TableStatus(str(path), False, str(e)), {}, registry)
        reason = _foreign(snapshot, sku, check_environment)
        if reason:
            return cls(sku, TableStatus(str(path), False, reason), {}, registry)
        entries, rejected, faults, faulty, stale = _entries(snapshot, sku, registry)
        rejected += tuple(snapshot.bad_rows)
        rows = sum(len(v) for v in entries.values())
        status = TableStatus(str(path), True, f"{rows} rows for {sku.label()}", rows, rejected,
                             faulty)
        return cls(sku, status, entries, registry, faults, stale)

    def select(self, problem: MoEProblem, layout: WeightLayout = WeightLayout.PLAIN) -> Selection:
        """The kernel for ``problem``: memoized, deterministic per problem."""
        key = problem if layout is WeightLayout.PLAIN else (problem, layout)
        hit = self._memo.get(key)  # type: ignore[arg-type]
        if hit is None:
            hit = self._memo[key] = self._decide(problem, layout)  # type: ignore[index]
        return hit

    def covers(self, shape: Shape) -> bool:
        """Whether the table has a usable row for ``shape`` at any num_tokens."""
        return shape in self._points

    def shapes(self) -> tuple[Shape, ...]:
        """The shapes the table has usable rows for."""
        return tuple(self._points)

    def buckets(self, shape: Shape) -> tuple[int, ...]:
        """The num_tokens of the table's usable rows for ``shape``, ascending (empty if none)."""
        return tuple(self._points.get(shape, ()))

    def faults(self, shape: Shape) -> dict[int, str]:
        """num_tokens -> reason for the buckets of ``shape`` whose row is faulty (see
        ``TableStatus.faulty_rows``); ``select`` ignores those rows."""
        return dict(self._faults.get(shape, {}))

    def _decide(self, problem: MoEProblem, layout: WeightLayout) -> Selection:
        points = self._points.get(problem.shape)
        if not self.status.usable:
            why = f"table not used: {self.status.reason}"
        elif not points:
            refused = self._refused.get(problem.shape)
            first = min(refused) if refused else None
            why = "shape not in table" if first is None else (
                f"the table's {len(refused)} rows for this shape are not served here (M={first}: "
                f"{refused[first]})")
        else:
            rows = self._entries[problem.shape]
            chosen = rows[bisect.bisect_left(points, nearest(problem.num_tokens, points))]
            kernel = self.registry.get(chosen.selection.kernel)
            ok, not_ok = kernel.supports(problem, self.sku)
            if ok and kernel.layout is layout:
                return dataclasses.replace(
                    chosen.selection, rule_pick=is_rule_pick(chosen.selection.kernel,
                                                             chosen.selection.params, problem,
                                                             self.sku))
            why = not_ok or f"winner needs the {kernel.layout.value} weight layout"
        rule = rule_choice(problem, self.sku)
        return Selection(rule.kernel, rule.params, "rule", f"{why}; {rule.reason}",
                         rule_pick=True)


def _foreign(snapshot: TableSnapshot, sku: SKU, check_environment: bool) -> str | None:
    """Why a table must not be used here, or None."""
    here = (sku.vendor.value, sku.name, sku.arch)
    if not any((s["vendor"], s["name"], s["arch"]) == here for s in snapshot.skus):
        theirs = ", ".join(f"{s['vendor']}:{s['name']} ({s['arch']})" for s in snapshot.skus)
        return f"table is for {theirs or 'no SKU'}, this device is {sku.label()}"
    if check_environment:
        mismatches = environment_mismatches(snapshot.environment, environment())
        if mismatches:
            return "measured in another environment: " + "; ".join(mismatches)
    return None


def _entries(snapshot: TableSnapshot, sku: SKU, registry: Registry) -> tuple[
        dict[Shape, list[_Entry]], tuple[str, ...], dict[Shape, dict[int, str]], tuple[str, ...],
        dict[Shape, dict[int, str]]]:
    """Rows this SKU can serve, grouped by shape and sorted by num_tokens; why the others
    cannot (rows for other SKUs are neither); the faulty ones among them, by bucket and
    as messages (unreadable rows of ``snapshot.bad_winners`` included); and the stale ones
    by bucket."""
    entries: dict[Shape, list[_Entry]] = {}
    rejected: list[str] = []
    faults: dict[Shape, dict[int, str]] = {}
    faulty: list[str] = []
    stale: dict[Shape, dict[int, str]] = {}
    for row in snapshot.rows:
        verdict = row_verdict(row, sku, registry)
        if verdict.other_sku:
            continue
        if verdict.selection is None:
            rejected.append(f"bucket {row.bucket}: {verdict.reason}")
            if not verdict.stale:
                _fault(faults, faulty, row.bucket, verdict.problem, verdict.reason)
            elif verdict.problem is not None:
                stale.setdefault(verdict.problem.shape, {})[verdict.problem.num_tokens] = \
                    verdict.reason
            continue
        entries.setdefault(verdict.problem.shape, []).append(
            _Entry(verdict.problem.num_tokens, verdict.selection))
    here = {"vendor": sku.vendor.value, "name": sku.name, "arch": sku.arch}
    for row_sku, bucket, reason in snapshot.bad_winners:
        if {k: row_sku[k] for k in here} == here:
            try:
                problem: MoEProblem | None = MoEProblem.from_row(bucket)
            except (MoetuneError, KeyError, TypeError, ValueError):
                problem = None
            _fault(faults, faulty, bucket, problem, reason)
    for rows in entries.values():
        rows.sort(key=lambda e: e.num_tokens)
    return entries, tuple(rejected), faults, tuple(faulty), stale


def _fault(faults: dict[Shape, dict[int, str]], faulty: list[str], bucket: dict[str, Any],
           problem: MoEProblem | None, reason: str) -> None:
    faulty.append(f"bucket {bucket}: {reason}")
    if problem is not None:
        faults.setdefault(problem.shape, {})[problem.num_tokens] = reason


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


def row_verdict(row: WinnerRecord, sku: SKU, registry: Registry = default_registry) -> RowVerdict:
    """The one check of a winner row, shared by serving, ``show`` and ``tune --skip-tuned``.

    A row is served when it is valid (``row_problem``, the part ``merge``, ``export`` and
    ``import`` share: its bucket and kernel are known and its params lie in the kernel's
    declared space) and, for measured rows, today's rule here is one of the baselines it was
    timed against: if the winner beat it the winner runs, if not the rule's pick runs. Imported
    rows won nothing here; they are the user's choice and serve as they are.
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
    rule = rule_choice(problem, sku)
    rule_key = params_key(rule.params)
    measured = next((b for b in row.baselines if b["kernel"] == rule.kernel
                     and params_key(b["params"]) == rule_key), None)
    if measured is None:
        tried = "; ".join(f"{b['kernel']} {params_key(b['params'])}" for b in row.baselines)
        return RowVerdict(None, f"stale: tuned against {tried or 'no baseline'}, but the rule "
                                f"here is {rule.kernel} {params_key(rule.params)} "
                                f"({rule.reason}): re-tune this bucket", problem, stale=True)
    if row.kernel == rule.kernel and params_key(params) == rule_key:
        return RowVerdict(served, "the winner is today's rule's pick", problem)
    if measured.get("beaten"):
        return RowVerdict(served, f"beat today's rule ({rule.kernel})", problem)
    kept = Selection(rule.kernel, rule.params, "table",
                     f"table: the rule's pick is as fast as any candidate at M="
                     f"{problem.num_tokens}", problem.num_tokens, measured.get("median_us"), 1.0)
    return RowVerdict(kept, "today's rule was not beaten: the rule's pick runs", problem)


def row_problem(row: WinnerRecord, registry: Registry = default_registry) -> str | None:
    """Why ``row`` is invalid on any device, or None: the row-level part of ``row_verdict``.

    A row is invalid when its bucket is not a MoE problem, its kernel is unknown, or its params
    lie outside the kernel's declared space. Staleness and the SKU are serving questions this
    leaves to ``row_verdict``. ``merge``, ``export`` and ``import`` drop the rows this refuses,
    with this reason (the one ``show`` prints); rows that ``read_winners`` could not parse are
    refused before any check.
    """
    return _validated(row, registry)[2]


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


def load_dispatcher(path: str | Path | None, sku: SKU, **kwargs: Any) -> Dispatcher:
    """``Dispatcher.load`` plus one log line saying what was loaded (or why not)."""
    dispatcher = Dispatcher.load(path, sku, **kwargs)
    st = dispatcher.status
    log = logger.info if st.usable else logger.warning
    log("moetune: table %s: %s%s", st.path, st.reason,
        f" ({len(st.rejected_rows)} rows rejected)" if st.rejected_rows else "")
    return dispatcher
