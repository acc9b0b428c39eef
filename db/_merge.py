"""Merging table files, e.g. buckets tuned on two machines of the same SKU; or copying one
(what ``export`` and ``import`` write). Only winners the row check accepts are copied."""

import contextlib
import dataclasses
import datetime
from pathlib import Path
from typing import Any, Callable

from sqlalchemy import select
from sqlalchemy.orm import Session

from moetune.db._baselines import BaselineRecord
from moetune.db._copy import IdMap, copy_provenance, copy_winner
from moetune.db._files import atomic_table, open_table, same_file
from moetune.db._models import BucketRow, SkuRow, TuningRun, WinnerRow
from moetune.db._read import WinnerRecord, read_winners
from moetune.db._schema import file_path, is_url
from moetune.db._server import display_url
from moetune.errors import TableError

#: Why a winner row must not be in a table, or None. ``db`` cannot judge kernels (it imports
#: nothing from the runtime), so callers hand in the runtime's check,
#: ``moetune.runtime.dispatcher.row_problem``, the one serving and ``show`` use.
RowCheck = Callable[[WinnerRecord], str | None]

_Key = tuple[tuple[Any, ...], tuple[Any, ...]]


@dataclasses.dataclass(frozen=True)
class MergeConflict:
    """One (sku, bucket) with different winners in the two tables, and how it was settled."""

    sku: dict[str, Any]
    bucket: dict[str, Any]
    kernel_a: str
    kernel_b: str
    median_us_a: float | None
    median_us_b: float | None
    winner: str  # "a" or "b"
    reason: str

    def __str__(self) -> str:
        return (
            f"{_where(self.sku, self.bucket)}: a={self.kernel_a} {_us(self.median_us_a)}, "
            f"b={self.kernel_b} {_us(self.median_us_b)} -> {self.winner} ({self.reason})"
        )


@dataclasses.dataclass(frozen=True)
class DroppedRow:
    """A winner left out of the output because it is invalid: unreadable (params or baselines
    that are not JSON), or refused by the row check (unknown kernel, params outside its space)."""

    table: str
    sku: dict[str, Any]
    bucket: dict[str, Any]
    reason: str

    def __str__(self) -> str:
        return f"{_where(self.sku, self.bucket)} from {self.table}: {self.reason}"


def _where(sku: dict[str, Any], bucket: dict[str, Any]) -> str:
    return f"{sku['name']} " + " ".join(f"{k}={v}" for k, v in bucket.items())


def _us(value: float | None) -> str:
    return "no time" if value is None else f"{value:.2f}us"


@dataclasses.dataclass(frozen=True)
class MergeReport:
    """What ``merge_tables`` wrote: winners in total and from each side, every conflict, and
    every winner dropped as invalid."""

    output: Path
    rows: int
    from_a: int
    from_b: int
    conflicts: list[MergeConflict]
    dropped: list[DroppedRow] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Candidate:
    side: str
    winner: WinnerRow
    started_at: datetime.datetime
    ids: IdMap
    #: The rule variant its speedup is over (``WinnerRecord.tuned_against``).
    rule: BaselineRecord | None


def merge_tables(a: str | Path, b: str | Path | None, out: str | Path, *,
                 check: RowCheck | None, include_measurements: bool = True,
                 strict: bool = False, update_a: bool = False) -> MergeReport:
    """Write the union of tables ``a`` and ``b`` to ``out`` (atomically).

    ``out`` must not be an input: it is rebuilt from scratch, so what the inputs hold but the
    output leaves out (invalid rows, measurements without ``include_measurements``) would be
    gone. Only with ``update_a`` may ``out`` be ``a`` (an import into an existing table).

    With ``b`` None, ``a`` alone is copied: what ``export`` and ``import`` write. SKUs, buckets,
    runs and (unless ``include_measurements`` is false) measurements are kept, re-identified
    (rows already present, e.g. when ``b`` was exported from ``a``, are not duplicated).

    Invalid winners are left out first, so they never win a bucket, and listed in the report
    with the reason: those ``read_winners`` cannot parse (params or baselines that are not
    JSON) and those ``check`` refuses (``check=None`` keeps every readable winner). Winners
    that are valid but that serving would not use here (another SKU's, stale ones) are kept.
    Where both have a winner for the same (SKU, bucket), one rule decides, in this order:

    0. *Measured beats imported*: a winner a tuning run measured beats one imported from vLLM
       or aiter files; between two imports without both times, the newer import wins.
    1. *Statistical tie, newer run wins*: if the two runs started at different times and each
       median lies within the other's ``[p20_us, p80_us]``, the winner from the run that
       started later wins. The times cannot tell the two apart, and the newer run measured
       the newer software.
    2. *Higher speedup over the same rule pick wins*: where both rows were timed against the
       same rule pick (``BaselineRecord.stands_for`` either way: kernel, params, and the vLLM
       and configs it stands for), each side by side in its own run, the higher ``speedup``
       wins. The ratio cancels what drifts between machines and days (the same H200 timed
       vLLM's pick at Mixtral-8x7B's 4096 tokens 1.4% faster two days later, so every row of
       the later run looked faster by its median alone). Unless each speedup lies within the
       range the other row's own spread implies (``baseline_us / p80_us`` to
       ``baseline_us / p20_us``): that is a tie too, and the newer run wins as in 1, so a row
       timed on a quieter day never displaces a newer one by noise alone.
    3. *Faster median wins*: otherwise the lower ``median_us`` wins.
    4. *Exact tie*: equal medians from runs started at the same time keep ``a``.

    Identical winners (same kernel, params and times) are not reported as conflicts.

    Args:
        a: A table (file or server URL).
        b: Another table, or None to copy ``a`` alone.
        out: The table file to write; an existing one must be a moetune table and is replaced.
        check: The row check, ``moetune.runtime.dispatcher.row_problem``; or None.
        include_measurements: Also copy every trial (large; needed to resume or audit).
        strict: Refuse to write anything if a winner is invalid.
        update_a: ``out`` is ``a``, updated with ``b``'s winners.

    Raises:
        TableError: If an input cannot be read or ``out`` cannot be written; or, leaving
            ``out`` untouched, if it is an input (but ``a`` with ``update_a``), if a winner is
            invalid and ``strict``, or if every winner is.
    """
    sources = {"a": a} if b is None else {"a": a, "b": b}
    for side, path in sources.items():
        if same_file(out, path) and not (update_a and side == "a"):
            raise TableError(f"{_label(out)}: not written, it is also an input; write to "
                             "another file, then move it over the input if that is what you "
                             "want")
    invalid: dict[str, dict[_Key, DroppedRow]] = {}
    rules: dict[str, dict[_Key, BaselineRecord | None]] = {}
    for side, path in sources.items():
        invalid[side], rules[side] = _read_side(path, check)
    valid = sum(len(r) for r in rules.values())
    dropped = [d for rows in invalid.values() for d in sorted(rows.values(), key=_order)]
    if dropped and (strict or not valid):
        why = "invalid winners" if strict else "every winner is invalid"
        raise TableError(f"{_label(out)}: not written, {why}:"
                         + "".join(f"\n  {d}" for d in dropped))
    with contextlib.ExitStack() as stack:
        sessions = {side: stack.enter_context(stack.enter_context(open_table(path)).session())
                    for side, path in sources.items()}
        merged = stack.enter_context(atomic_table(out, start_from_existing=False))
        target = stack.enter_context(merged.session())
        candidates = {
            side: _candidates(session, side,
                              copy_provenance(session, target,
                                              include_measurements=include_measurements),
                              rules[side])
            for side, session in sessions.items()
        }
        winners_a, winners_b = candidates["a"], candidates.get("b", {})
        counts = {"a": 0, "b": 0}
        conflicts = []
        for key in sorted(winners_a.keys() | winners_b.keys()):
            first, second = winners_a.get(key), winners_b.get(key)
            if first is not None and second is not None:
                chosen, reason = _choose(first, second)
                if reason is not None:
                    conflicts.append(_conflict(sessions["a"], first, second, chosen, reason))
            else:
                chosen = first or second
            counts[chosen.side] += 1
            copy_winner(target, chosen.winner, chosen.ids)
    return MergeReport(file_path(out), counts["a"] + counts["b"], counts["a"], counts["b"],
                       conflicts, dropped)


def _read_side(path: str | Path, check: RowCheck | None) -> tuple[
        dict[_Key, DroppedRow], dict[_Key, BaselineRecord | None]]:
    """The winners of ``path`` that must not be copied, and the rule variant of each that may,
    by (SKU, bucket)."""
    snapshot = read_winners(path)
    label = _label(path)
    invalid = {_key(sku, bucket): DroppedRow(label, sku, bucket, why)
               for sku, bucket, why in snapshot.bad_winners}
    rules = {}
    for row in snapshot.rows:
        why = None if check is None else check(row)
        if why is None:
            rules[_key(row.sku, row.bucket)] = row.tuned_against
        else:
            invalid[_key(row.sku, row.bucket)] = DroppedRow(label, row.sku, row.bucket, why)
    return invalid, rules


def _order(row: DroppedRow) -> tuple[Any, ...]:
    """SKU, then shape, then num_tokens: how a report lists rows (a damaged row's values may
    be of any type, or None: each sorts after its type's name)."""
    shape = (v for k, v in row.bucket.items() if k != "num_tokens")
    return tuple((type(v).__name__, v if v is not None else 0)
                 for v in (row.sku["name"], *shape, row.bucket["num_tokens"]))


def _key(sku: dict[str, Any], bucket: dict[str, Any]) -> _Key:
    return tuple(sorted(sku.items())), tuple(sorted(bucket.items()))


def _label(path: str | Path) -> str:
    return display_url(str(path)) if is_url(path) else str(path)


def _candidates(session: Session, side: str, ids: IdMap,
                rules: dict[_Key, BaselineRecord | None]) -> dict[tuple[int, int], _Candidate]:
    """A table's valid winners (those in ``rules``) keyed by the *output's* (sku_id,
    bucket_id), so both sides align."""
    query = (
        select(WinnerRow.id, SkuRow, BucketRow)
        .join(SkuRow, WinnerRow.sku_id == SkuRow.id)
        .join(BucketRow, WinnerRow.bucket_id == BucketRow.id)
    )
    rows = [(i, _key(sku.key(), bucket.key())) for i, sku, bucket in session.execute(query)]
    winners = [(session.get_one(WinnerRow, i), key) for i, key in rows
               if key in rules]  # only these convert safely
    return {
        (ids.skus[w.sku_id], ids.buckets[w.bucket_id]):
            _Candidate(side, w, session.get_one(TuningRun, w.run_id).started_at, ids, rules[key])
        for w, key in winners
    }


def _choose(a: _Candidate, b: _Candidate) -> tuple[_Candidate, str | None]:
    """Apply the documented rule; the reason is ``None`` when the two winners are identical."""
    wa, wb = a.winner, b.winner
    same = (wa.kernel, wa.params, wa.median_us, wa.p20_us, wa.p80_us)
    if same == (wb.kernel, wb.params, wb.median_us, wb.p20_us, wb.p80_us):
        return a, None
    if (wa.source == "measured") != (wb.source == "measured"):
        return (a if wa.source == "measured" else b), "measured here beats imported"
    if wa.median_us is None or wb.median_us is None or wa.p20_us is None or wb.p20_us is None:
        newer = b if b.started_at > a.started_at else a
        return newer, "no times to compare; newer import"
    if a.started_at != b.started_at and _tied((wa.median_us, (wa.p20_us, wa.p80_us)),
                                              (wb.median_us, (wb.p20_us, wb.p80_us))):
        return _newer(a, b), "newer run; medians within each other's p20-p80 spread"
    same_rule = (a.rule is not None and b.rule is not None and a.rule.stands_for(b.rule)
                 and b.rule.stands_for(a.rule))
    if same_rule and wa.speedup and wb.speedup and wa.speedup != wb.speedup:
        range_a, range_b = _speedup_range(wa), _speedup_range(wb)
        if (range_a and range_b and a.started_at != b.started_at
                and _tied((wa.speedup, range_a), (wb.speedup, range_b))):
            return _newer(a, b), "newer run; speedups within each other's p20-p80 spread"
        reason = "higher speedup over the same rule pick"
        return (a, reason) if wa.speedup > wb.speedup else (b, reason)
    if wa.median_us != wb.median_us:
        return (a, "faster median") if wa.median_us < wb.median_us else (b, "faster median")
    return a, "equal medians from runs started together; kept a"


def _tied(a: tuple[float, tuple[float, float]], b: tuple[float, tuple[float, float]]) -> bool:
    """Each (value, (low, high)) lies within the other's range: the two cannot be told apart."""
    (va, (lo_a, hi_a)), (vb, (lo_b, hi_b)) = a, b
    return lo_a <= vb <= hi_a and lo_b <= va <= hi_b


def _newer(a: _Candidate, b: _Candidate) -> _Candidate:
    return a if a.started_at > b.started_at else b


def _speedup_range(w: WinnerRow) -> tuple[float, float] | None:
    """The speedups the row's p80 and p20 times imply against its own rule time."""
    if not (w.baseline_us and w.p20_us and w.p80_us):
        return None
    return w.baseline_us / w.p80_us, w.baseline_us / w.p20_us


def _conflict(
    session_a: Session, a: _Candidate, b: _Candidate, chosen: _Candidate, reason: str
) -> MergeConflict:
    sku = session_a.get(SkuRow, a.winner.sku_id)
    bucket = session_a.get(BucketRow, a.winner.bucket_id)
    return MergeConflict(
        sku=sku.key(),
        bucket=bucket.key(),
        kernel_a=a.winner.kernel,
        kernel_b=b.winner.kernel,
        median_us_a=a.winner.median_us,
        median_us_b=b.winner.median_us,
        winner=chosen.side,
        reason=reason,
    )
