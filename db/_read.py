"""The read API: a whole table as plain frozen values, loaded once.

The dispatcher loads a table at startup and never touches the database again, so nothing here
returns ORM objects or keeps a connection open. One malformed row is reported, not raised:
serving falls back for that bucket instead of crashing.
"""

import dataclasses
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from moetune.db._files import open_table
from moetune.db._schema import is_url
from moetune.db._jsontext import load_json
from moetune.db._models import (
    BUCKET_COLUMNS,
    BucketRow,
    Measurement,
    SkuRow,
    TuningRun,
    WinnerRow,
)


@dataclasses.dataclass(frozen=True)
class WinnerRecord:
    """One winner with its SKU and bucket spelled out (``bucket`` has the 10 key columns).

    ``source`` is ``measured`` for tuning results; imported rows (``vllm-json``, ``aiter-csv``)
    have no baseline time or speedup, and rows from vLLM files no time at all.
    """

    sku: dict[str, Any]
    bucket: dict[str, Any]
    kernel: str
    params: dict[str, Any]
    median_us: float | None
    p20_us: float | None
    p80_us: float | None
    error: float | None
    baseline_kernel: str
    baseline_params: dict[str, Any]
    baseline_us: float | None
    speedup: float | None
    run_id: int
    source: str = "measured"
    #: The rule variants timed beside the winner in its confirmation, each a dict with
    #: ``kernel``, ``params``, ``median_us``, ``p20_us``, ``p80_us``, ``rounds``, ``ratio_lo``,
    #: ``ratio_hi`` and ``beaten``. Empty for imported rows; rows tuned before schema 0003 have
    #: the one baseline of the ``baseline_*`` fields (``beaten``: the winner is not it).
    baselines: tuple[dict[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class TableSnapshot:
    """Everything serving needs from one table file.

    Attributes:
        path: The file (or server URL) read.
        schema_revision: Its Alembic revision on disk (older ones are upgraded in memory).
        skus: Every SKU in the file, as plain dicts.
        environment: Versions recorded by the newest run that has winners (``{}`` if none).
        rows: The winners that parsed.
        bad_rows: One reason per row that was skipped because it could not be used.
        bad_winners: (sku, bucket, reason) of each winner row among ``bad_rows``, so serving
            can tell which bucket lost its row.
    """

    path: Path | str
    schema_revision: str
    skus: list[dict[str, Any]]
    environment: dict[str, Any]
    rows: list[WinnerRecord]
    bad_rows: list[str] = dataclasses.field(default_factory=list)
    bad_winners: list[tuple[dict[str, Any], dict[str, Any], str]] = dataclasses.field(
        default_factory=list)


def read_winners(path: str | Path) -> TableSnapshot:
    """Load every winner of a table file into memory.

    Raises:
        TableError: If the file is missing, corrupt, not a moetune table, or newer than us.
            Malformed rows do not raise; they are listed in ``bad_rows``.
    """
    path = path if is_url(path) else Path(path)
    bad_rows: list[str] = []
    bad_winners: list[tuple[dict[str, Any], dict[str, Any], str]] = []
    rows: list[WinnerRecord] = []
    with open_table(path) as table, table.session() as session:
        skus = [sku.key() for sku in session.scalars(select(SkuRow).order_by(SkuRow.id))]
        environment = _newest_environment(session, bad_rows)
        query = (
            select(WinnerRow, SkuRow, BucketRow)
            .join(SkuRow, WinnerRow.sku_id == SkuRow.id)
            .join(BucketRow, WinnerRow.bucket_id == BucketRow.id)
            .order_by(WinnerRow.id)
        )
        for winner, sku, bucket in session.execute(query):
            where = f"winner {winner.id} ({winner.kernel}, bucket {bucket.key()})"
            try:
                params = load_json(winner.params)
                baseline_params = load_json(winner.baseline_params)
            except ValueError as e:
                why = f"params are not a JSON object: {e}"
                bad_rows.append(f"{where}: {why}")
                bad_winners.append((sku.key(), bucket.key(), why))
                continue
            try:
                baselines = _baselines(winner, params, baseline_params)
            except (ValueError, TypeError, KeyError) as e:
                why = f"baselines are not a JSON list of objects: {e}"
                bad_rows.append(f"{where}: {why}")
                bad_winners.append((sku.key(), bucket.key(), why))
                continue
            rows.append(WinnerRecord(
                sku=sku.key(),
                bucket=bucket.key(),
                kernel=winner.kernel,
                params=params,
                median_us=winner.median_us,
                p20_us=winner.p20_us,
                p80_us=winner.p80_us,
                error=winner.error,
                baseline_kernel=winner.baseline_kernel,
                baseline_params=baseline_params,
                baseline_us=winner.baseline_us,
                speedup=winner.speedup,
                run_id=winner.run_id,
                source=winner.source,
                baselines=baselines,
            ))
        revision = table.revision
    return TableSnapshot(path, revision, skus, environment, rows, bad_rows, bad_winners)


def _baselines(winner: WinnerRow, params: dict[str, Any],
               baseline_params: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The row's baselines; a row from before schema 0003 has its one ``baseline_*``."""
    if winner.baselines is not None:
        variants = load_json(winner.baselines)["variants"]
        if not all(isinstance(v, dict) and isinstance(v["params"], dict) for v in variants):
            raise ValueError("a baseline is not an object with params")
        return tuple(variants)
    if winner.source != "measured":
        return ()
    same = (winner.kernel, params) == (winner.baseline_kernel, baseline_params)
    return ({"kernel": winner.baseline_kernel, "params": baseline_params,
             "median_us": winner.baseline_us, "beaten": not same},)


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


def _newest_environment(session: Session, bad_rows: list[str]) -> dict[str, Any]:
    """The environment of the newest run that measured a winner; what the runtime validates
    against. A run killed or failed part-way still published the winners it finished."""
    run = session.scalars(
        select(TuningRun)
        .where(TuningRun.id.in_(select(WinnerRow.run_id)))
        .order_by(TuningRun.started_at.desc(), TuningRun.id.desc())
        .limit(1)
    ).first()
    if run is None:
        return {}
    try:
        return load_json(run.environment)
    except ValueError as e:
        bad_rows.append(f"run {run.id}: environment is not a JSON object: {e}")
        return {}
