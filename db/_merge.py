"""Merging two table files, e.g. buckets tuned on two machines of the same SKU."""

import dataclasses
import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from moetune.db._copy import IdMap, copy_provenance, copy_winner
from moetune.db._files import atomic_table, open_table
from moetune.db._models import BucketRow, SkuRow, TuningRun, WinnerRow


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
        shape = " ".join(f"{k}={v}" for k, v in self.bucket.items())
        return (
            f"{self.sku['name']} {shape}: a={self.kernel_a} {_us(self.median_us_a)}, "
            f"b={self.kernel_b} {_us(self.median_us_b)} -> {self.winner} ({self.reason})"
        )


def _us(value: float | None) -> str:
    return "no time" if value is None else f"{value:.2f}us"


@dataclasses.dataclass(frozen=True)
class MergeReport:
    """What ``merge_tables`` wrote: winners in total and from each side, and every conflict."""

    output: Path
    rows: int
    from_a: int
    from_b: int
    conflicts: list[MergeConflict]


@dataclasses.dataclass(frozen=True)
class _Candidate:
    side: str
    winner: WinnerRow
    started_at: datetime.datetime
    ids: IdMap


def merge_tables(a: str | Path, b: str | Path, out: str | Path) -> MergeReport:
    """Write the union of tables ``a`` and ``b`` to ``out`` (atomically; ``out`` may be ``a``).

    SKUs, buckets, runs and measurements of both are kept, re-identified (rows already present,
    e.g. when ``b`` was exported from ``a``, are not duplicated). Where both have a winner for
    the same (SKU, bucket), one rule decides, in this order:

    0. *Measured beats imported*: a winner a tuning run measured beats one imported from vLLM
       or aiter files; between two imports without both times, the newer import wins.
    1. *Statistical tie, newer run wins*: if the two runs started at different times and each
       median lies within the other's ``[p20_us, p80_us]``, the winner from the run that
       started later wins. The times cannot tell the two apart, and the newer run measured
       the newer software.
    2. *Faster median wins*: otherwise the lower ``median_us`` wins.
    3. *Exact tie*: equal medians from runs started at the same time keep ``a``.

    Identical winners (same kernel, params and times) are not reported as conflicts.

    Raises:
        TableError: If an input cannot be read or ``out`` cannot be written.
    """
    with open_table(a) as table_a, open_table(b) as table_b:
        with table_a.session() as session_a, table_b.session() as session_b:
            with atomic_table(out, start_from_existing=False) as merged, merged.session() as target:
                ids_a = copy_provenance(session_a, target, include_measurements=True)
                ids_b = copy_provenance(session_b, target, include_measurements=True)
                winners_a = _candidates(session_a, "a", ids_a)
                winners_b = _candidates(session_b, "b", ids_b)
                counts = {"a": 0, "b": 0}
                conflicts = []
                for key in sorted(winners_a.keys() | winners_b.keys()):
                    first, second = winners_a.get(key), winners_b.get(key)
                    if first is not None and second is not None:
                        chosen, reason = _choose(first, second)
                        if reason is not None:
                            conflicts.append(_conflict(session_a, first, second, chosen, reason))
                    else:
                        chosen = first or second
                    counts[chosen.side] += 1
                    copy_winner(target, chosen.winner, chosen.ids)
    return MergeReport(Path(out), counts["a"] + counts["b"], counts["a"], counts["b"], conflicts)


def _candidates(session: Session, side: str, ids: IdMap) -> dict[tuple[int, int], _Candidate]:
    """A table's winners keyed by the *output's* (sku_id, bucket_id), so both sides align."""
    query = select(WinnerRow, TuningRun.started_at).join(
        TuningRun, WinnerRow.run_id == TuningRun.id
    )
    return {
        (ids.skus[w.sku_id], ids.buckets[w.bucket_id]): _Candidate(side, w, started_at, ids)
        for w, started_at in session.execute(query)
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
    tied = wa.p20_us <= wb.median_us <= wa.p80_us and wb.p20_us <= wa.median_us <= wb.p80_us
    if tied and a.started_at != b.started_at:
        newer = a if a.started_at > b.started_at else b
        return newer, "newer run; medians within each other's p20-p80 spread"
    if wa.median_us != wb.median_us:
        return (a, "faster median") if wa.median_us < wb.median_us else (b, "faster median")
    return a, "equal medians from runs started together; kept a"


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
