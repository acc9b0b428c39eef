"""Copying rows between table files, re-identified by natural keys; and ``export_sqlite``.

Row ids are local to a file. SKUs and buckets are matched by their unique keys, runs by what
identifies a tuner invocation (SKU, host, command, start time), and measurements by their run,
bucket, candidate and timestamp. Copying the same rows twice therefore adds nothing, which
makes exports and merges idempotent.
"""

import dataclasses
from pathlib import Path
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from moetune.db._files import atomic_table, open_table, same_file
from moetune.db._models import BucketRow, Measurement, SkuRow, TuningRun, WinnerRow
from moetune.db._tuning import get_or_create_bucket, get_or_create_sku
from moetune.errors import TableError

_REMAPPED = frozenset({"id", "sku_id", "bucket_id", "run_id"})


@dataclasses.dataclass(frozen=True)
class IdMap:
    """Source id -> target id, per table, for one copy."""

    skus: dict[int, int]
    buckets: dict[int, int]
    runs: dict[int, int]


def copy_provenance(source: Session, target: Session, *, include_measurements: bool) -> IdMap:
    """Copy every SKU, bucket and run (and optionally measurement) from ``source`` to ``target``.

    Winners are left to the caller, which decides which ones to keep.
    """
    skus = {
        sku.id: get_or_create_sku(
            target, sku.vendor, sku.name, sku.arch, sku.compute_units, sku.memory_bytes
        ).id
        for sku in source.scalars(select(SkuRow).order_by(SkuRow.id))
    }
    buckets = {
        bucket.id: get_or_create_bucket(target, **bucket.key()).id
        for bucket in source.scalars(select(BucketRow).order_by(BucketRow.id))
    }
    runs = {
        run.id: _copy_run(target, run, skus[run.sku_id]) for run in _readable_runs(source)
    }
    ids = IdMap(skus, buckets, runs)
    if include_measurements:
        _copy_measurements(source, target, ids)
    return ids


def copy_winner(target: Session, winner: WinnerRow, ids: IdMap) -> None:
    """Add ``winner`` (a row of the source) to ``target`` under the target's ids."""
    values = _columns(winner, exclude=_REMAPPED)
    target.add(WinnerRow(
        **values,
        sku_id=ids.skus[winner.sku_id],
        bucket_id=ids.buckets[winner.bucket_id],
        run_id=ids.runs[winner.run_id],
    ))


def export_sqlite(src: str | Path, dst: str | Path, *, include_measurements: bool = False) -> None:
    """Write a self-contained table artifact: schema, SKUs, runs, buckets, winners.

    ``dst`` is rebuilt from scratch and replaced atomically (``write_table`` semantics); rows
    are copied as stored, so even a row the reader would skip keeps its evidence.

    Args:
        src: The table to export.
        dst: The artifact to write; an existing one must be a moetune table and is replaced.
        include_measurements: Also copy every trial (large; needed to resume or audit).

    Raises:
        TableError: If ``src`` cannot be read or ``dst`` cannot be written or is ``src``.
    """
    if same_file(src, dst):
        raise TableError(f"{dst}: not written, it is the table exported")
    with open_table(src) as source_table, source_table.session() as source:
        with atomic_table(dst, start_from_existing=False) as out, out.session() as target:
            ids = copy_provenance(source, target, include_measurements=include_measurements)
            for winner in source.scalars(select(WinnerRow).order_by(WinnerRow.id)):
                copy_winner(target, winner, ids)


def _readable_runs(source: Session) -> list[TuningRun]:
    """The runs whose stored values convert to their columns' types; the others (a status or
    date edited into garbage) are left out with their trials, and each of their winners is
    dropped with the reason by the row check (``winner_fault``)."""
    runs = []
    for run_id in source.scalars(select(TuningRun.id).order_by(TuningRun.id)):
        try:
            runs.append(source.get_one(TuningRun, run_id))
        except (ValueError, LookupError):  # what SQLAlchemy's conversions raise
            continue
    return runs


def _copy_run(target: Session, run: TuningRun, sku_id: int) -> int:
    identity = {
        "sku_id": sku_id, "host": run.host, "command": run.command, "started_at": run.started_at
    }
    existing = target.scalars(select(TuningRun).filter_by(**identity)).first()
    if existing is not None:
        return existing.id
    copy = TuningRun(**_columns(run, exclude=_REMAPPED), sku_id=sku_id)
    target.add(copy)
    target.flush()
    return copy.id


def _copy_measurements(source: Session, target: Session, ids: IdMap) -> None:
    """Bulk-copy trials (there can be many thousands), skipping ones the target already has."""
    identity = (
        Measurement.run_id, Measurement.bucket_id, Measurement.kernel,
        Measurement.params, Measurement.created_at,
    )
    seen = set(target.execute(select(*identity)))
    rows = []
    for m in source.scalars(select(Measurement).where(Measurement.run_id.in_(ids.runs))
                            .order_by(Measurement.id)):
        row = {
            **_columns(m, exclude=_REMAPPED),
            "run_id": ids.runs[m.run_id],
            "bucket_id": ids.buckets[m.bucket_id],
        }
        key = (row["run_id"], row["bucket_id"], m.kernel, m.params, m.created_at)
        if key not in seen:
            seen.add(key)
            rows.append(row)
    if rows:
        target.execute(insert(Measurement), rows)


def _columns(row: Any, *, exclude: frozenset[str]) -> dict[str, Any]:
    """A row's column values by attribute name, leaving out the ids the target reassigns."""
    return {c.key: getattr(row, c.key) for c in row.__table__.columns if c.key not in exclude}
