"""What a table says about how it was made: every tuning run's provenance and every trial,
as plain values for reports and audits (serving reads neither)."""

import dataclasses
import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select

from moetune.db._files import open_table
from moetune.db._jsontext import json_or_none, load_json
from moetune.db._models import BUCKET_COLUMNS, BucketRow, Measurement, RunStatus, SkuRow, TuningRun
from moetune.db._tuning import process_gone


def read_measurements(
    path: str | Path, bucket_key: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Every trial in a table file, oldest first, as plain dicts for reports.

    Args:
        path: The table file.
        bucket_key: Keep only buckets matching these key columns; any subset of the 10 works
            (``{"num_tokens": 64}``). ``None`` keeps all.

    Returns:
        Dicts with ``id, run_id, sku, bucket, kernel, params`` (``None`` when its JSON is bad),
        ``params_json, median_us, p20_us, p80_us, samples, error, status`` (the enum value),
        ``reason`` and ``created_at`` (ISO 8601, UTC).

    Raises:
        ValueError: If ``bucket_key`` names a column that is not a bucket key column.
        TableError: If the file cannot be read as a moetune table.
    """
    conditions = []
    if bucket_key:
        unknown = sorted(set(bucket_key) - set(BUCKET_COLUMNS))
        if unknown:
            raise ValueError(f"unknown bucket columns {unknown}; expected some of {BUCKET_COLUMNS}")
        for column, value in bucket_key.items():
            conditions.append(getattr(BucketRow, column) == getattr(value, "value", value))
    query = (
        select(Measurement, BucketRow, SkuRow)
        .join(BucketRow, Measurement.bucket_id == BucketRow.id)
        .join(TuningRun, Measurement.run_id == TuningRun.id)
        .join(SkuRow, TuningRun.sku_id == SkuRow.id)
        .where(*conditions)
        .order_by(Measurement.id)
    )
    with open_table(path) as table, table.session() as session:
        return [
            _measurement_dict(m, bucket, sku)
            for m, bucket, sku in session.execute(query)
        ]


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One tuning run's provenance as plain values (``read_runs``).

    ``environment`` and ``ceilings`` are ``None`` when their stored JSON cannot be parsed;
    ``ceilings`` also on the CPU and for runs from before schema 0005. Times are naive UTC.
    ``status`` is as of reading: a run stored as ``running`` whose process on this host is gone
    reads ``interrupted`` (``process_gone``), as the next write will store it.
    """

    id: int
    sku: dict[str, Any]
    moetune_version: str
    commit: str | None
    environment: dict[str, Any] | None
    driver: str | None
    host: str
    command: str
    started_at: datetime.datetime
    finished_at: datetime.datetime | None
    status: str
    ceilings: dict[str, Any] | None


def read_runs(path: str | Path) -> list[RunRecord]:
    """Every tuning run of a table, oldest first.

    Raises:
        TableError: If the file cannot be read as a moetune table.
    """
    query = select(TuningRun, SkuRow).join(SkuRow, TuningRun.sku_id == SkuRow.id).order_by(
        TuningRun.id)
    with open_table(path) as table, table.session() as session:
        return [RunRecord(
            id=run.id, sku=sku.key(), moetune_version=run.moetune_version, commit=run.commit,
            environment=json_or_none(run.environment), driver=run.driver, host=run.host,
            command=run.command, started_at=run.started_at, finished_at=run.finished_at,
            status=(RunStatus.INTERRUPTED if process_gone(run) else run.status).value,
            ceilings=json_or_none(run.ceilings),
        ) for run, sku in session.execute(query)]


def _measurement_dict(m: Measurement, bucket: BucketRow, sku: SkuRow) -> dict[str, Any]:
    try:
        params: dict[str, Any] | None = load_json(m.params)
    except ValueError:
        params = None
    return {
        "id": m.id,
        "run_id": m.run_id,
        "sku": sku.key(),
        "bucket": bucket.key(),
        "kernel": m.kernel,
        "params": params,
        "params_json": m.params,
        "median_us": m.median_us,
        "p20_us": m.p20_us,
        "p80_us": m.p80_us,
        "samples": m.samples,
        "error": m.error,
        "status": m.status.value,
        "reason": m.reason,
        "created_at": m.created_at.isoformat(),
    }
