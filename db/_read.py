"""The read API: a table's winners as plain frozen values.

Nothing here returns ORM objects or keeps a connection open (serving's ``WinnerReader`` holds
one, and reads with the helpers here). One malformed row is reported, not raised: serving falls
back for that bucket instead of crashing.
"""

import dataclasses
import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, String, select, type_coerce
from sqlalchemy.orm import Session

from moetune.db._files import open_table
from moetune.db._schema import file_path, is_url
from moetune.db._jsontext import load_json
from moetune.db._rowcheck import bucket_fault, parse_baselines, winner_fault
from moetune.db._models import (
    BUCKET_COLUMNS,
    SKU_COLUMNS,
    BucketRow,
    Measurement,
    RunStatus,
    SkuRow,
    TuningRun,
    WinnerRow,
)
from moetune.db._tuning import process_gone


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
    #: The versions its run recorded (``runtime.platform.environment``); None when the run's
    #: are unreadable. Serving refuses a measured row timed under other versions.
    environment: dict[str, Any] | None = None


# Core columns, read as plain tuples (no ORM layer in the way), and each distinct JSON text
# parsed once: every vLLM process reads the table, and params repeat across buckets.
_W, _B = WinnerRow.__table__.c, BucketRow.__table__.c
_S, _R = SkuRow.__table__.c, TuningRun.__table__.c
_WINNERS = WinnerRow.__table__.join(BucketRow.__table__, _W.bucket_id == _B.id)
_WINNER_FIELDS = ("id", "kernel", "params", "median_us", "p20_us", "p80_us", "error",
                  "baseline_kernel", "baseline_params", "baseline_us", "speedup", "run_id",
                  "source", "baselines", "sku_id", "bucket_id")
# The run's environment, and the ids of the run and bucket found (None where they are gone);
# then the values a copy converts, as stored, for the row check to judge (``winner_fault``).
_STAMPS = {"updated_at": _W.updated_at, "run_started_at": _R.started_at,
           "run_finished_at": _R.finished_at, "run_status": _R.status}
_WINNER_COLUMNS = (*(_W[c] for c in _WINNER_FIELDS), _R.environment, _R.id, _B.id,
                   *(type_coerce(c, String) for c in _STAMPS.values()))
_WINNER_NAMES = (*_WINNER_FIELDS, "environment", "run_ref", "bucket_ref", *_STAMPS)
_BUCKET_COLUMNS = tuple(_B[c] for c in BUCKET_COLUMNS)


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
    """Load every winner of a table file into memory, in one transaction.

    Raises:
        TableError: If the file is missing, corrupt, not a moetune table, or newer than us.
            Malformed rows do not raise; they are listed in ``bad_rows``.
    """
    path = path if is_url(path) else file_path(path)
    with open_table(path) as table, table.session() as session:
        return read_snapshot(session, path, table.revision, read_header(session))


@dataclasses.dataclass(frozen=True)
class TableHeader:
    """What a table says besides its winners: ``skus`` by row id, the ``environment`` serving
    validates against, and its problem, if any, in ``bad_rows``."""

    skus: dict[int, dict[str, Any]]
    environment: dict[str, Any]
    bad_rows: tuple[str, ...]


def read_header(session: Session) -> TableHeader:
    """The header of the table ``session`` reads."""
    query = select(_S.id, *(_S[c] for c in SKU_COLUMNS)).order_by(_S.id)
    skus = {values[0]: dict(zip(SKU_COLUMNS, values[1:])) for values in session.execute(query)}
    bad_rows: list[str] = []
    environment = _newest_environment(session, bad_rows)
    return TableHeader(skus, environment, tuple(bad_rows))


def read_snapshot(session: Session, path: Path | str, revision: str, header: TableHeader,
                  *where: ColumnElement[bool]) -> TableSnapshot:
    """The winners matching ``where`` (all without it), in id order, as a ``TableSnapshot``
    whose ``bad_rows`` start with the header's."""
    bad_rows = list(header.bad_rows)
    bad_winners: list[tuple[dict[str, Any], dict[str, Any], str]] = []
    rows: list[WinnerRecord] = []
    parsed: dict[Any, dict[str, Any]] = {}

    def parse(text: Any) -> dict[str, Any]:
        value = parsed.get(text)
        if value is None:
            value = parsed[text] = load_json(text)
        return dict(value)

    # Outer joins: a winner whose SKU, bucket or run is gone is a bad row, not a missing one.
    query = select(*_WINNER_COLUMNS, *_BUCKET_COLUMNS) \
        .select_from(WinnerRow.__table__.outerjoin(BucketRow.__table__, _W.bucket_id == _B.id)
                     .outerjoin(TuningRun.__table__, _W.run_id == _R.id)).where(*where) \
        .order_by(_W.id)
    for values in session.execute(query):
        stored = dict(zip(_WINNER_NAMES, values[:len(_WINNER_NAMES)]))
        bucket = dict(zip(BUCKET_COLUMNS, values[len(_WINNER_NAMES):]))
        sku = header.skus.get(stored["sku_id"])
        record, why = _record(stored, sku, bucket, parse)
        if record is None:
            sku = sku or _missing_sku(stored["sku_id"])
            bad_rows.append(f"winner {stored['id']} ({_text(stored['kernel'])}, bucket {bucket})"
                            f": {why}")
            bad_winners.append((sku, bucket, why))
        else:
            rows.append(record)
    return TableSnapshot(path, revision, list(header.skus.values()), header.environment, rows,
                         bad_rows, bad_winners)


def _record(stored: dict[str, Any], sku: dict[str, Any] | None, bucket: dict[str, Any],
            parse: Callable[[Any], dict[str, Any]]) -> tuple[WinnerRecord | None, str]:
    """The row as a ``WinnerRecord``, or None and why it cannot be one (``winner_fault``,
    a dangling reference, JSON that is not what it must be)."""
    if sku is None:
        return None, f"its SKU {_text(stored['sku_id'])} does not exist"
    if stored["bucket_ref"] is None:
        return None, f"its bucket {_text(stored['bucket_id'])} does not exist"
    if stored["run_ref"] is None:
        return None, f"its run {_text(stored['run_id'])} does not exist"
    fault = bucket_fault(bucket) or winner_fault(stored)
    if fault is not None:
        return None, fault
    try:
        params, baseline_params = parse(stored["params"]), parse(stored["baseline_params"])
    except ValueError as e:
        return None, f"params are not a JSON object: {e}"
    try:
        baselines = _baselines(stored, (stored["kernel"], params),
                               (stored["baseline_kernel"], baseline_params))
    except ValueError as e:
        return None, f"baselines are not a JSON list of objects: {e}"
    return WinnerRecord(
        sku=sku, bucket=bucket, kernel=stored["kernel"], params=params,
        median_us=stored["median_us"], p20_us=stored["p20_us"], p80_us=stored["p80_us"],
        error=stored["error"], baseline_kernel=stored["baseline_kernel"],
        baseline_params=baseline_params, baseline_us=stored["baseline_us"],
        speedup=stored["speedup"], run_id=stored["run_id"], source=stored["source"],
        baselines=baselines, environment=json_or_none(stored["environment"], parse),
    ), ""


def _missing_sku(sku_id: Any) -> dict[str, Any]:
    """What a winner whose SKU row is gone is listed under: no device matches it."""
    return {**dict.fromkeys(SKU_COLUMNS), "name": f"missing SKU {_text(sku_id)}"}


def _text(value: Any) -> str:
    """A stored value in a reason, cut to 40 characters (a damaged field may be huge)."""
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _baselines(stored: dict[str, Any], winner: tuple[str, dict[str, Any]],
               baseline: tuple[str, dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """The row's baselines; a row from before schema 0003 has its one ``baseline_*``."""
    if stored["baselines"] is not None:
        return parse_baselines(stored["baselines"])
    if stored["source"] != "measured":
        return ()
    return ({"kernel": baseline[0], "params": baseline[1], "median_us": stored["baseline_us"],
             "beaten": winner != baseline},)


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


def json_or_none(text: str | None,
                 parse: Callable[[str], dict[str, Any]] = load_json) -> dict[str, Any] | None:
    """A stored JSON object (read by ``parse``), or None where there is none or it cannot be
    parsed."""
    try:
        return None if text is None else parse(text)
    except ValueError:
        return None


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
    run = session.execute(
        select(_R.id, _R.environment)
        .where(select(_W.id).where(_W.run_id == _R.id).exists())
        .order_by(_R.started_at.desc(), _R.id.desc())
        .limit(1)
    ).first()
    if run is None:
        return {}
    try:
        return load_json(run.environment)
    except ValueError as e:
        bad_rows.append(f"run {run.id}: environment is not a JSON object: {e}")
        return {}
