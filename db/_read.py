"""The read API: a table's winners as plain frozen values (runs and trials: ``_history``).

Nothing here returns ORM objects or keeps a connection open (serving's ``WinnerReader`` holds
one, and reads with the helpers here). One malformed row is reported, not raised: serving falls
back for that bucket instead of crashing.
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, String, select, type_coerce
from sqlalchemy.orm import Session

from moetune.db._baselines import SCHEMA1_VLLM, BaselineRecord, Candidate
from moetune.db._files import open_table
from moetune.db._jsontext import json_or_none, load_json
from moetune.db._models import BUCKET_COLUMNS, SKU_COLUMNS, BucketRow, SkuRow, TuningRun, WinnerRow
from moetune.db._rowcheck import bucket_fault, parse_baselines, winner_fault
from moetune.db._schema import file_path, is_url


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
    #: The rule variants timed beside the winner in its confirmation, the rule where it was
    #: tuned first (the ``baseline_*`` fields). Empty for imported rows; rows tuned before
    #: schema 0003 have the one baseline of the ``baseline_*`` fields (``beaten``: the winner
    #: is not it), standing for the vLLM a schema-1 variant does (``SCHEMA1_VLLM``).
    baselines: tuple[BaselineRecord, ...] = ()
    #: The versions its run recorded (``runtime.platform.environment``); None when the run's
    #: are unreadable. Serving refuses a measured row timed under other versions.
    environment: dict[str, Any] | None = None

    @property
    def tuned_against(self) -> BaselineRecord | None:
        """The rule variant where the row was tuned, which ``speedup`` is over (None for
        imported rows)."""
        return self.baselines[0] if self.baselines else None


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
        baselines = _baselines(stored, Candidate(stored["kernel"], params),
                               Candidate(stored["baseline_kernel"], baseline_params))
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


def _baselines(stored: dict[str, Any], winner: Candidate,
               baseline: Candidate) -> tuple[BaselineRecord, ...]:
    """The row's baselines; a row from before schema 0003 has its one ``baseline_*``."""
    if stored["baselines"] is not None:
        return parse_baselines(stored["baselines"])
    if stored["source"] != "measured":
        return ()
    return (BaselineRecord(baseline, SCHEMA1_VLLM.get(baseline.kernel),
                           median_us=stored["baseline_us"], beaten=winner != baseline),)


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
