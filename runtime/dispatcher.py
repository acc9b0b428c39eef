"""The dispatcher: a table checked once at load, then a dict lookup per MoE call.

``select(problem)`` returns the table's winner for the problem's bucket when the table is valid
for this device and has a usable row for that shape, else the rule-based pick with the reason.
Loading checks the whole file (schema, SKU, environment); a shape's rows are read and judged
when the shape is first asked for (``runtime/_table_rows.py`` says why). Nothing here touches
the database on the call path; nothing here raises because of a table.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from pathlib import Path
from typing import Any

from moetune.db import WinnerReader
from moetune.errors import DeviceError, MoetuneError
from moetune.runtime._table_rows import NO_ROWS, ShapeRows, TableRows
from moetune.runtime._verdict import RowVerdict, Selection, row_point, row_problem, row_verdict
from moetune.runtime.kernels.base import WeightLayout
from moetune.runtime.platform import (SKU, Vendor, environment, environment_mismatches,
                                      normalize_device_name)
from moetune.runtime.problem import MoEProblem, Shape, nearest
from moetune.runtime.registry import Registry, default_registry
from moetune.runtime.rules import is_rule_pick, rule_choice

__all__ = ["Dispatcher", "RowVerdict", "Selection", "TableStatus", "adopted_table",
           "default_table", "row_point", "row_problem", "row_verdict", "shipped_table"]

TABLES_DIR = Path(__file__).resolve().parent / "tables"


def shipped_table(sku: SKU) -> Path:
    """Where the table shipped for ``sku`` lives: ``runtime/tables/<vendor>_<name>.db``."""
    return TABLES_DIR / f"{sku.vendor.value}_{sku.name}.db"


def adopted_table(sku: SKU) -> Path:
    """Where ``moetune adopt`` keeps this machine's copy of the shipped table, re-confirmed
    under the versions installed here: ``$MOETUNE_HOME/tables/<vendor>_<name>.db``, by default
    under ``$XDG_DATA_HOME/moetune`` (``~/.local/share/moetune``). Outside the installed
    package, so an upgrade or a read-only site-packages leaves it alone."""
    home = os.environ.get("MOETUNE_HOME")
    if not home:
        data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
        home = Path(data) / "moetune"
    return Path(home) / "tables" / shipped_table(sku).name


def table_sku(spec: str, path: str | Path | None = None) -> tuple[SKU, str]:
    """The SKU ``spec`` (``vendor:name``, e.g. ``nvidia:H200``) as its table records it, and that
    table (``path``, else the one shipped for it): to answer for a device that is not here.

    Raises:
        DeviceError: ``spec`` is not ``vendor:name``, or the table has no such SKU.
        TableError: The table cannot be read.
    """
    vendor, _, name = spec.partition(":")
    try:
        wanted = SKU(Vendor(vendor.lower()), normalize_device_name(name), "", 0, 0)
    except ValueError:
        raise DeviceError(f"--sku {spec}: expected VENDOR:NAME with VENDOR one of "
                          f"{[v.value for v in Vendor]}, e.g. nvidia:H200") from None
    table = str(path or shipped_table(wanted))
    with WinnerReader(table) as reader:
        skus = reader.skus
    found = next((s for s in skus if (s["vendor"], s["name"]) == (wanted.vendor.value,
                                                                    wanted.name)), None)
    if found is None:
        have = ", ".join(f"{s['vendor']}:{s['name']}" for s in skus) or "none"
        raise DeviceError(f"--sku {spec}: table {table} has no rows for it (it has: {have})")
    return SKU(wanted.vendor, found["name"], found["arch"], found["compute_units"],
               found["memory_bytes"]), table


def default_table(sku: SKU) -> Path | None:
    """The table serving, ``lookup`` and ``doctor`` use when none is given: this machine's
    adopted copy if there is one, else the shipped table, else None."""
    return next((p for p in (adopted_table(sku), shipped_table(sku)) if p.is_file()), None)


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


class Dispatcher:
    """Maps MoE problems to kernels. Build with ``load``; ``select`` is safe on the hot path.

    A shape's rows are judged by the first call that asks for the shape (``select``,
    ``covers``, ``buckets``, ``faults``, ``faulty_rows``); ``status`` and ``shapes`` need every
    row judged, and the first of them judges the whole table.

    Thread safety: judging holds the table's lock; ``select`` then reads the judged rows and
    fills a memo dict (a benign race: two threads compute the same value).
    """

    def __init__(self, sku: SKU, path: str | None, registry: Registry = default_registry, *,
                 rows: TableRows | None = None, unusable: str = "") -> None:
        """A dispatcher serving ``rows``, or, without them, the rules because of ``unusable``."""
        self.sku = sku
        self.registry = registry
        self.path = path
        self._rows = rows
        self._status = None if rows is not None else TableStatus(path, False, unusable)
        self._memo: dict[MoEProblem, Selection] = {}

    @classmethod
    def load(cls, path: str | Path | None, sku: SKU, *, registry: Registry = default_registry,
             check_environment: bool = True) -> Dispatcher:
        """Open ``path`` and check the whole file. Any problem with it leaves a dispatcher that
        uses the rules, with the reason in ``status``.

        The rows are judged a shape at a time, not here: a vLLM process serves one or two
        shapes, and judging 10,000 rows takes 0.5-1 s on a 2-core CPU. A table that
        ``WinnerReader`` does not hold live (an older schema upgraded in memory, a server) is
        judged whole here instead, as it cannot be read from another thread or process later.
        """
        if path is None:
            return cls(sku, None, registry, unusable="no table configured")
        try:
            reader = WinnerReader(path)
        except (MoetuneError, OSError) as e:
            return cls(sku, str(path), registry, unusable=str(e))
        reason = _foreign(reader.skus, reader.environment, sku, check_environment)
        rows = None
        try:
            rows = None if reason else TableRows(
                reader, sku, registry, environment() if check_environment else None)
        except MoetuneError as e:
            reason = str(e)
        if rows is None:
            reader.close()
            return cls(sku, str(path), registry, unusable=reason)
        if not reader.live:
            rows.whole()
        return cls(sku, str(path), registry, rows=rows)

    @property
    def usable(self) -> bool:
        """Whether the table passed the whole-file checks at load (schema, SKU, environment)."""
        return self._rows is not None

    @property
    def table_rows(self) -> int:
        """The table's rows for this SKU, served or not: known at load, without judging any."""
        return 0 if self._rows is None else self._rows.rows

    @property
    def status(self) -> TableStatus:
        """How loading went. A usable table's counts need every row judged: the first read
        judges the whole table (what ``load`` did before it judged per shape), which is what
        ``strict`` needs at startup to refuse a table with faulty rows."""
        if self._status is None:
            assert self._rows is not None
            whole = self._rows.whole()
            self._status = TableStatus(self.path, False, whole.error) if whole.error else \
                TableStatus(self.path, True, f"{whole.rows} rows for {self.sku.label()}",
                            whole.rows, whole.rejected, whole.faulty)
        return self._status

    def select(self, problem: MoEProblem, layout: WeightLayout = WeightLayout.PLAIN) -> Selection:
        """The kernel for ``problem``: memoized, deterministic per problem."""
        key = problem if layout is WeightLayout.PLAIN else (problem, layout)
        hit = self._memo.get(key)  # type: ignore[arg-type]
        if hit is None:
            hit = self._memo[key] = self._decide(problem, layout)  # type: ignore[index]
        return hit

    def covers(self, shape: Shape) -> bool:
        """Whether the table has a usable row for ``shape`` at any num_tokens."""
        return bool(self._shape(shape).entries)

    def shapes(self) -> tuple[Shape, ...]:
        """The shapes the table has usable rows for (judges every row, as ``status`` does)."""
        return () if self._rows is None else self._rows.whole().shapes

    def buckets(self, shape: Shape) -> tuple[int, ...]:
        """The num_tokens of the table's usable rows for ``shape``, ascending (empty if none)."""
        return self._shape(shape).points

    def faults(self, shape: Shape) -> dict[int, str]:
        """num_tokens -> reason for the buckets of ``shape`` whose row is faulty (see
        ``TableStatus.faulty_rows``); ``select`` ignores those rows."""
        return dict(self._shape(shape).faults)

    def refused(self, shape: Shape) -> dict[int, str]:
        """num_tokens -> reason for every bucket of ``shape`` whose row is not served (faulty,
        as in ``faults``, or stale)."""
        return dict(self._shape(shape).refused)

    def faulty_rows(self, shape: Shape) -> tuple[str, ...]:
        """The lines of ``status.faulty_rows`` for ``shape``'s buckets, without judging other
        shapes: a vLLM process warns about those of the shapes its layers have."""
        return self._shape(shape).faulty

    def _shape(self, shape: Shape) -> ShapeRows:
        return NO_ROWS if self._rows is None else self._rows.shape(shape)

    def _decide(self, problem: MoEProblem, layout: WeightLayout) -> Selection:
        rows = self._shape(problem.shape)
        if self._rows is None:
            why = f"table not used: {self.status.reason}"
        elif rows.unreadable:
            why = f"the table's rows for this shape cannot be read: {rows.unreadable}"
        elif not rows.entries:
            first = min(rows.refused) if rows.refused else None
            why = "shape not in table" if first is None else (
                f"the table's {len(rows.refused)} rows for this shape are not served here "
                f"(M={first}: {rows.refused[first]})")
        else:
            chosen = rows.entries[bisect.bisect_left(rows.points,
                                                     nearest(problem.num_tokens, rows.points))]
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


def _foreign(skus: list[dict[str, Any]], table_environment: dict[str, Any], sku: SKU,
             check_environment: bool) -> str | None:
    """Why a table with these SKUs, measured in ``table_environment``, must not be used here."""
    here = (sku.vendor.value, sku.name, sku.arch)
    if not any((s["vendor"], s["name"], s["arch"]) == here for s in skus):
        theirs = ", ".join(f"{s['vendor']}:{s['name']} ({s['arch']})" for s in skus)
        return f"table is for {theirs or 'no SKU'}, this device is {sku.label()}"
    if check_environment:
        mismatches = environment_mismatches(table_environment, environment())
        if mismatches:
            return ("measured in another environment: " + "; ".join(mismatches)
                    + " (re-confirm it here, seconds per bucket: moetune adopt for the table "
                    "shipped with moetune, moetune tune --reconfirm --output COPY for a copy of "
                    "another)")
    return None
