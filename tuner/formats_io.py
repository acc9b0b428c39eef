"""What the formats share: telling a file's format, the report, the row check, and writing
imported winners into a table.

Every row that goes into or out of a table passes the dispatcher's own check,
``row_problem`` (known bucket and kernel, params in the kernel's declared space): an invalid
row is skipped with that reason, the text ``show`` gives. Valid rows that serving would not
use today (stale ones) are kept, and ``stale_note`` says how many.

Imported winners are written like a tuning run's: one finished run per SKU (its ``command``
names the source file) and one winner per bucket. No measurements are written, because the
source did not measure anything moetune can time again: a resumed ``tune`` must not skip a
candidate because aiter's tuner once timed it differently. The run records this process's
versions (plus what the source states, e.g. a vLLM file's Triton version), so import on the
machine whose table you extend. Into an existing table, imports go through ``merge_tables``:
per bucket the faster median stays, and an existing SKU row is reused for the same device.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import enum
import tempfile
from pathlib import Path
from typing import Any, Iterable

from moetune import db
from moetune.errors import FormatError
from moetune.runtime.dispatcher import row_problem, row_verdict
from moetune.runtime.platform import SKU, Vendor, environment
from moetune.runtime.problem import MoEProblem

_SQLITE_MAGIC = b"SQLite format 3\x00"


class Format(str, enum.Enum):
    SQLITE = "sqlite"
    VLLM = "vllm"
    AITER = "aiter"


def detect(path: Path) -> Format:
    """The format of ``path``: a moetune table, vLLM tuned-config JSON (a file or a folder of
    them) or aiter's ``tuned_fmoe.csv``.

    Raises:
        FormatError: ``path`` is missing or none of these.
    """
    path = Path(path)
    if path.is_dir():
        return Format.VLLM
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror or e})") from None
    text = head.decode("utf-8", "replace").lstrip()
    first_line = text.splitlines()[0] if text else ""
    if head.startswith(_SQLITE_MAGIC) or path.suffix in (".db", ".sqlite"):
        return Format.SQLITE
    if path.suffix == ".json" or text.startswith("{"):
        return Format.VLLM
    if path.suffix == ".csv" or first_line.replace(" ", "").startswith(("cu_num,", "token,")):
        return Format.AITER
    raise FormatError(
        f"{path}: cannot tell its format; expected a moetune table (SQLite), a vLLM tuned-config "
        "JSON (E=..,N=..,device_name=...json, or a folder of them) or aiter's tuned_fmoe.csv")


@dataclasses.dataclass
class FormatReport:
    """What an export or import did: rows written, rows skipped by reason, and notes."""

    action: str
    written: int = 0
    outputs: list[Path] = dataclasses.field(default_factory=list)
    skipped: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    notes: list[str] = dataclasses.field(default_factory=list)

    def skip(self, reason: str, count: int = 1) -> None:
        self.skipped[reason] += count

    def text(self) -> str:
        where = ", ".join(str(p) for p in self.outputs) or "-"
        lines = [f"{self.action} {self.written} rows -> {where}"]
        if self.skipped:
            lines.append(f"skipped {sum(self.skipped.values())} rows:")
            lines += [f"  {n:>5}  {reason}" for reason, n in self.skipped.most_common()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ImportedWinner:
    """One foreign row as a moetune winner. The source measured no baseline: the row records
    the pick the source makes by default (``baseline_params``, else its own) without a time,
    and no time at all when the source has none (vLLM files)."""

    sku: SKU
    problem: MoEProblem
    kernel: str
    params: dict[str, Any]
    median_us: float | None
    source: str
    baseline_params: dict[str, Any] | None = None

    def key(self) -> tuple[tuple[str, str, str], MoEProblem]:
        return (self.sku.vendor.value, self.sku.name, self.sku.arch), self.problem

    def record(self) -> db.WinnerRecord:
        """The row as ``read_winners`` will read it back, for the row check."""
        baseline = self.params if self.baseline_params is None else self.baseline_params
        return db.WinnerRecord(self.sku.to_row(), self.problem.to_row(), self.kernel, self.params,
                               self.median_us, self.median_us, self.median_us, None,
                               self.kernel, baseline, None, None, 0, self.source)

    def entry(self) -> db.WinnerEntry:
        """The row as ``_write`` sets it: the source's time as all three, no baseline time."""
        baseline = self.params if self.baseline_params is None else self.baseline_params
        return db.WinnerEntry(self.kernel, self.params, self.median_us, self.median_us,
                              self.median_us, None, self.kernel, baseline, None,
                              source=self.source)


def keep_fastest(winners: list[ImportedWinner], report: FormatReport) -> list[ImportedWinner]:
    """One winner per (device, bucket): the fastest; the others are counted as duplicates."""
    best: dict[Any, ImportedWinner] = {}
    for w in winners:
        old = best.get(w.key())
        if old is not None:
            report.skip("duplicate (device, bucket) after mapping; kept the faster")
        if old is None or _time(w) < _time(old):
            best[w.key()] = w
    return list(best.values())


def _time(w: ImportedWinner) -> float:
    return math.inf if w.median_us is None else w.median_us


def write_winners(winners: list[ImportedWinner], output: Path, source: str,
                  report: FormatReport, env_overrides: dict[str, Any] | None = None
                  ) -> db.MergeReport | None:
    """Write the valid ``winners`` to the table ``output`` (merged in when it exists).

    Winners the row check refuses are skipped with its reason, then one per (device, bucket)
    is kept (``keep_fastest``); ``report`` counts both and the rows written. Invalid rows of
    an existing ``output`` are dropped by the merge and noted.

    Raises:
        FormatError: no winner is left to write (``output`` is left untouched).
        TableError: ``output`` is not a table or cannot be written.
    """
    valid = []
    for w in winners:
        invalid = row_problem(w.record())
        if invalid is None:
            valid.append(w)
        else:
            report.skip(invalid)
    winners = keep_fastest(valid, report)
    if not winners:
        raise FormatError(f"{source}: nothing to import\n{report.text()}")
    output = Path(output)
    env = {**environment(), **(env_overrides or {})}
    command = f"moetune import {source}"
    report.written = len(winners)
    if not output.exists():
        _write(winners, output, env, command)
        return None
    existing = {(s["vendor"], s["name"], s["arch"]): s for s in db.read_winners(output).skus}
    winners = [_reuse_sku(w, existing) for w in winners]
    with tempfile.TemporaryDirectory(dir=output.absolute().parent, prefix=".import.") as tmp:
        part = Path(tmp) / "imported.db"
        _write(winners, part, env, command)
        merged = merge_valid(output, part, output, update=True)
    report.notes += [f"dropped {d}" for d in merged.dropped]
    return merged


def merge_valid(a: str | Path, b: str | Path | None, out: str | Path, *,
                include_measurements: bool = True, strict: bool = False,
                update: bool = False) -> db.MergeReport:
    """``db.merge_tables`` with the dispatcher's row check: invalid winners are dropped (or,
    ``strict``, refused) with its reason. ``b`` None copies ``a`` alone (export, import);
    ``update``: ``out`` is ``a``, updated with ``b`` (import into an existing table).

    Raises:
        TableError: see ``db.merge_tables``.
    """
    return db.merge_tables(a, b, out, check=row_problem,
                           include_measurements=include_measurements, strict=strict,
                           update_a=update)


def merge_notes(merged: db.MergeReport) -> list[str]:
    """One line per winner ``merged`` dropped, naming its bucket, table and reason; and how
    many of the rows it wrote are stale here (``stale_note``)."""
    lines = [f"dropped {d}" for d in merged.dropped]
    stale = stale_note(db.read_winners(merged.output).rows)
    return lines + ([f"note: {stale}"] if stale else [])


def stale_note(rows: Iterable[db.WinnerRecord]) -> str | None:
    """How many of ``rows`` are stale on their SKU by today's rule as this machine sees it
    (kept: serving runs the rule's pick for them until re-tuned), or None if none are."""
    stale = 0
    for r in rows:
        try:
            sku = SKU.from_row(r.sku)
        except ValueError:  # a vendor this moetune does not know: nothing to judge it by
            continue
        stale += row_verdict(r, sku).stale
    if not stale:
        return None
    return (f"stale rows kept: {stale} (not timed against today's rule for their SKU, as this "
            "machine sees it: serving runs the rule's pick for them until they are re-tuned)")


def _reuse_sku(w: ImportedWinner, existing: dict[tuple[str, str, str], dict[str, Any]]
               ) -> ImportedWinner:
    """The same device must be one SKU row, or the dispatcher would see two winners per bucket."""
    s = existing.get(w.key()[0])
    if s is None:
        return w
    sku = SKU(Vendor(s["vendor"]), s["name"], s["arch"], s["compute_units"], s["memory_bytes"])
    return dataclasses.replace(w, sku=sku)


def _write(winners: list[ImportedWinner], path: Path, env: dict[str, Any], command: str) -> None:
    db.TableWriter(path).import_winners(
        [(w.sku.to_row(), w.problem.to_row(), w.entry()) for w in winners],
        environment=env, command=command)
