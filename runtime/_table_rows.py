"""A usable table's rows for one SKU, judged a shape at a time.

Judging a row (``row_verdict``: its params and baselines parsed, today's rule evaluated) is most
of what loading a large table costs, and a vLLM process serves one or two of its shapes. So
``TableRows`` reads and judges a shape's rows the first time the shape is asked for, and the
whole table only when every row must be counted (``Dispatcher.status``, ``strict``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

from moetune.db import TableSnapshot, WinnerReader
from moetune.errors import MoetuneError, TableError
from moetune.runtime._verdict import Selection, row_verdict
from moetune.runtime.platform import SKU
from moetune.runtime.problem import (Activation, DType, MoEProblem, QuantScheme, Shape,
                                     bucket_text)
from moetune.runtime.registry import Registry


@dataclasses.dataclass(frozen=True)
class Entry:
    num_tokens: int
    selection: Selection


@dataclasses.dataclass(frozen=True)
class ShapeRows:
    """One shape's rows as serving sees them.

    Attributes:
        entries: The served rows, by num_tokens (``points``).
        faults: num_tokens -> why, for the rows that are broken, not merely stale.
        refused: num_tokens -> why, for every row not served (faulty or stale).
        faulty: The lines of ``TableStatus.faulty_rows`` for the shape's faulty rows.
        unreadable: Why the shape's rows could not be read (a file damaged after load).
    """

    entries: tuple[Entry, ...] = ()
    points: tuple[int, ...] = ()
    faults: dict[int, str] = dataclasses.field(default_factory=dict)
    refused: dict[int, str] = dataclasses.field(default_factory=dict)
    faulty: tuple[str, ...] = ()
    unreadable: str | None = None


NO_ROWS = ShapeRows()

_FIELDS = tuple(f.name for f in dataclasses.fields(Shape))
_ENUM_VALUES = {c: {m.value for m in kind} for c, kind in (
    ("dtype", DType), ("quant", QuantScheme), ("activation", Activation))}


def _written(shape: Shape) -> tuple[Any, ...]:
    """``shape``'s bucket columns as moetune writes them (enums by value)."""
    return tuple(getattr(v, "value", v) for v in (getattr(shape, c) for c in _FIELDS))


@dataclasses.dataclass(frozen=True)
class Judgement:
    """Every row of the table judged: what ``TableStatus`` counts, and the shapes with served
    rows in the order of their first one; or, in ``error``, why the rows could not be read."""

    error: str | None = None
    rows: int = 0
    rejected: tuple[str, ...] = ()
    faulty: tuple[str, ...] = ()
    shapes: tuple[Shape, ...] = ()


class TableRows:
    """The rows of one SKU in the table ``reader`` holds open, judged a shape at a time.

    Thread safety: judging holds a lock (one read of the table at a time); a shape is judged
    once, so what ``shape`` returns for it never changes.

    Raises:
        TableError: If the table's shapes cannot be read (at construction only).
    """

    def __init__(self, reader: WinnerReader, sku: SKU, registry: Registry,
                 environment: Mapping[str, Any] | None = None) -> None:
        self._reader, self._sku, self._registry = reader, sku, registry
        self._environment = environment
        self._here = (sku.vendor.value, sku.name, sku.arch)
        #: The stored shapes (``WinnerReader.shapes``) whose rows may be a shape's, by
        #: ``_written(shape)``, and how many rows they have.
        self._keys: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        self._counts: dict[tuple[Any, ...], int] = {}
        #: This SKU's rows, served or not.
        self.rows = 0
        for key, count in reader.shapes(self._here):
            self.rows += count
            written = tuple(key[c] for c in _FIELDS)
            if not all(key[c] in values for c, values in _ENUM_VALUES.items()):
                try:  # written by hand ("BFloat16"): the shape ``row_verdict`` will parse
                    written = _written(MoEProblem.from_row({"num_tokens": 1, **key}).shape)
                except (MoetuneError, KeyError, TypeError, ValueError):
                    continue  # no shape's: only the whole table's judgement lists its rows
            self._keys.setdefault(written, []).append(key)
            self._counts[written] = self._counts.get(written, 0) + count
        self._judged: dict[Shape, ShapeRows] = {}
        self._whole: Judgement | None = None
        self._lock = threading.Lock()

    def shape(self, shape: Shape) -> ShapeRows:
        """``shape``'s rows, read and judged on its first call."""
        rows = self._judged.get(shape)
        if rows is None:
            with self._lock:
                rows = self._judged.get(shape)
                if rows is None:
                    rows = self._read(shape)
        return rows

    def whole(self) -> Judgement:
        """Every row judged (once; the table is closed after it)."""
        with self._lock:
            if self._whole is None:
                self._whole = self._judge_all()
            return self._whole

    def _read(self, shape: Shape) -> ShapeRows:
        keys = self._keys.get(_written(shape))
        if keys is None:
            return NO_ROWS
        if self._whole is not None:  # every row is judged: the shape has none that serve
            return ShapeRows(unreadable=self._whole.error) if self._whole.error else NO_ROWS
        try:
            snapshot = self._reader.read(self._here, keys)
        except TableError as e:
            rows = self._judged[shape] = ShapeRows(unreadable=str(e))
            return rows
        if len(snapshot.rows) + len(snapshot.bad_winners) != self._counts[_written(shape)]:
            # Stored values the shape's filter does not match (a boolean column edited to 2):
            # the whole table's rows, grouped as read, are the shape's rows.
            self._whole = self._judge_all()
            return self._judged.get(shape, NO_ROWS)
        judged = judge(snapshot, self._sku, self._registry, self._environment)[0]
        rows = self._judged[shape] = judged.get(shape, NO_ROWS)
        return rows

    def _judge_all(self) -> Judgement:
        try:
            snapshot = self._reader.read()
        except TableError as e:
            return Judgement(error=str(e))
        finally:
            self._reader.close()  # every row is judged now: nothing is left to read
        shapes, rejected, faulty = judge(snapshot, self._sku, self._registry, self._environment)
        for shape, rows in shapes.items():
            self._judged.setdefault(shape, rows)
        return Judgement(None, sum(len(r.entries) for r in shapes.values()),
                         (*rejected, *snapshot.bad_rows), tuple(faulty),
                         tuple(s for s, r in shapes.items() if r.entries))


def judge(snapshot: TableSnapshot, sku: SKU, registry: Registry,
          environment: Mapping[str, Any] | None = None) -> tuple[
        dict[Shape, ShapeRows], list[str], list[str]]:
    """The rows of ``snapshot`` for ``sku`` by shape (rows for other SKUs are skipped), shapes
    with served rows first; and, as ``TableStatus`` lists them, each row not served (rejected)
    and the faulty ones among them, unreadable rows of ``snapshot.bad_winners`` included.
    ``environment``: the versions here, for ``row_verdict``."""
    entries: dict[Shape, list[Entry]] = {}
    faults: dict[Shape, dict[int, str]] = {}
    faulty_of: dict[Shape, list[str]] = {}
    stale: dict[Shape, dict[int, str]] = {}
    rejected: list[str] = []
    faulty: list[str] = []

    def fault(bucket: dict[str, Any], problem: MoEProblem | None, reason: str) -> None:
        line = f"bucket {bucket_text(bucket)}: {reason}"
        faulty.append(line)
        if problem is not None:
            faults.setdefault(problem.shape, {})[problem.num_tokens] = reason
            faulty_of.setdefault(problem.shape, []).append(line)

    for row in snapshot.rows:
        verdict = row_verdict(row, sku, registry, environment)
        if verdict.other_sku:
            continue
        if verdict.selection is None:
            rejected.append(f"bucket {bucket_text(row.bucket)}: {verdict.reason}")
            if not verdict.stale:
                fault(row.bucket, verdict.problem, verdict.reason)
            elif verdict.problem is not None:
                stale.setdefault(verdict.problem.shape, {})[verdict.problem.num_tokens] = \
                    verdict.reason
            continue
        entries.setdefault(verdict.problem.shape, []).append(
            Entry(verdict.problem.num_tokens, verdict.selection))
    here = {"vendor": sku.vendor.value, "name": sku.name, "arch": sku.arch}
    for row_sku, bucket, reason in snapshot.bad_winners:
        if {k: row_sku[k] for k in here} == here:
            try:
                problem: MoEProblem | None = MoEProblem.from_row(bucket)
            except (MoetuneError, KeyError, TypeError, ValueError):
                problem = None
            fault(bucket, problem, reason)
    shapes = {}
    for shape in dict.fromkeys((*entries, *faults, *stale)):
        served = sorted(entries.get(shape, ()), key=lambda e: e.num_tokens)
        shapes[shape] = ShapeRows(tuple(served), tuple(e.num_tokens for e in served),
                                  faults.get(shape, {}),
                                  {**stale.get(shape, {}), **faults.get(shape, {})},
                                  tuple(faulty_of.get(shape, ())))
    return shapes, rejected, faulty
