"""What the tuner writes, one call per fact, inside a session of a writable table.

Each helper takes plain values (or the runtime's ``str`` enums, stored by value) so the tuner
never builds ORM rows itself, and every parameter dict goes through the one canonical encoder.
Rows passed in may come from an earlier, closed session: only their ids are used.
"""

import datetime
import math
import os
import socket
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from moetune import __version__
from moetune.db._baselines import BaselineRecord, dump_baselines
from moetune.db._jsontext import dump_json
from moetune.db._models import (
    BUCKET_COLUMNS,
    BucketRow,
    Measurement,
    MeasurementStatus,
    RunStatus,
    SkuRow,
    WINNER_SOURCES,
    TuningRun,
    WinnerRow,
)
from moetune.errors import TableError

_BUCKET_INTS = ("num_tokens", "hidden_size", "intermediate_size", "num_experts", "topk")
_BUCKET_STRS = ("dtype", "quant", "activation")
_BUCKET_BOOLS = ("gated", "router_weight_on_input")


def utcnow() -> datetime.datetime:
    """Now, as the naive UTC timestamp every table stores."""
    return datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)


def get_or_create_sku(
    session: Session, vendor: str, name: str, arch: str, compute_units: int, memory_bytes: int
) -> SkuRow:
    """The SKU row for (vendor, name, arch, compute_units), created on first use.

    An existing row keeps its recorded ``memory_bytes``: the unique key decides identity.
    """
    key = _sku_key(vendor, name, arch, compute_units)
    query = select(SkuRow).filter_by(**key)
    sku = session.scalars(query).one_or_none()
    if sku is None:
        sku = _add_unique(session, SkuRow(**key, memory_bytes=int(memory_bytes)), query)
    return sku


def find_sku(session: Session, vendor: str, name: str, arch: str,
             compute_units: int) -> SkuRow | None:
    """The SKU row for (vendor, name, arch, compute_units) if the table has one: the lookup of
    ``get_or_create_sku``, for read-only sessions."""
    key = _sku_key(vendor, name, arch, compute_units)
    return session.scalars(select(SkuRow).filter_by(**key)).one_or_none()


def _sku_key(vendor: str, name: str, arch: str, compute_units: int) -> dict[str, Any]:
    return {"vendor": _value(vendor), "name": name, "arch": arch,
            "compute_units": int(compute_units)}


def bucket_key(key: dict[str, Any]) -> dict[str, Any]:
    """Check and normalise the 10 bucket key columns (enums to their values, exact types).

    Raises:
        ValueError: If a column is missing or unknown; the message lists the expected names.
    """
    missing = [c for c in BUCKET_COLUMNS if c not in key]
    unknown = sorted(set(key) - set(BUCKET_COLUMNS))
    if missing or unknown:
        raise ValueError(
            f"bucket key needs exactly {', '.join(BUCKET_COLUMNS)}; "
            f"missing {missing or 'none'}, unknown {unknown or 'none'}"
        )
    row: dict[str, Any] = {c: int(key[c]) for c in _BUCKET_INTS}
    row.update({c: _value(key[c]) for c in _BUCKET_STRS})
    row.update({c: bool(key[c]) for c in _BUCKET_BOOLS})
    return row


def get_or_create_bucket(session: Session, **key: Any) -> BucketRow:
    """The bucket row for the 10 key columns (``**MoEProblem.to_row()`` fits), created on first use.

    Raises:
        ValueError: If the key columns are not exactly the 10 bucket columns.
    """
    row = bucket_key(key)
    query = select(BucketRow).filter_by(**row)
    bucket = session.scalars(query).one_or_none()
    if bucket is None:
        bucket = _add_unique(session, BucketRow(**row), query)
    return bucket


def find_bucket(session: Session, **key: Any) -> BucketRow | None:
    """The bucket row for the 10 key columns if the table has one (read-only sessions).

    Raises:
        ValueError: If the key columns are not exactly the 10 bucket columns.
    """
    return session.scalars(select(BucketRow).filter_by(**bucket_key(key))).one_or_none()


def _add_unique(session: Session, row: Any, query: Select[Any]) -> Any:
    """Insert ``row``; if another writer (a job on another host, same server table) inserted
    the same unique key since we looked, return that row instead."""
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
        return row
    except IntegrityError:
        return session.scalars(query).one()


def start_run(
    session: Session,
    sku: SkuRow,
    environment: dict[str, Any],
    command: str,
    commit: str | None,
    driver: str | None,
    ceilings: dict[str, float] | None = None,
) -> TuningRun:
    """Record that a tuning run began in this process on this host, with the versions it runs
    under (the host and pid tell a later writer whether the run's process is still alive) and,
    on a GPU, the ceilings measured there (``tuner.roofline.Ceilings.to_dict()``)."""
    run = TuningRun(
        sku_id=sku.id,
        moetune_version=__version__,
        commit=commit,
        environment=dump_json(environment),
        driver=driver,
        host=socket.gethostname(),
        pid=os.getpid(),
        command=command,
        ceilings=None if ceilings is None else dump_json(ceilings),
        started_at=utcnow(),
        status=RunStatus.RUNNING,
    )
    session.add(run)
    session.flush()
    return run


def get_run(session: Session, run_id: int) -> TuningRun:
    """The run a job started, to add its results to.

    Raises:
        TableError: The run's row is gone: a program that does not take moetune's table lock
            replaced the file while the job ran.
    """
    run = session.get(TuningRun, run_id)
    if run is None:
        raise TableError(f"run {run_id} is no longer in the table: another program replaced "
                         "the file while this job ran")
    return run


def mark_interrupted(session: Session) -> None:
    """Mark ``interrupted`` every run still ``running`` whose process on this host is gone.

    A run of another host, or from before schema 0004 (no pid), is left alone: its process
    cannot be checked from here. A recycled pid keeps a dead run ``running`` (never the
    reverse). ``finished_at`` stays empty: when the process died is not known.
    """
    runs = session.scalars(select(TuningRun).where(
        TuningRun.status == RunStatus.RUNNING, TuningRun.host == socket.gethostname(),
        TuningRun.pid.is_not(None))).all()
    for run in runs:
        if process_gone(run):
            run.status = RunStatus.INTERRUPTED
    session.flush()


def process_gone(run: TuningRun) -> bool:
    """Whether ``run`` is still marked ``running`` but its process on this host is gone (what
    ``mark_interrupted`` stores, and readers show before the next write stores it)."""
    return (run.status is RunStatus.RUNNING and run.host == socket.gethostname()
            and run.pid is not None and not _process_alive(run.pid))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def finish_run(session: Session, run: TuningRun, status: RunStatus | str) -> None:
    """Mark a run finished or failed, stamping ``finished_at``; ``run`` is updated in place."""
    session.add(run)
    run.status = RunStatus(status)
    run.finished_at = utcnow()
    session.flush()


def add_measurement(
    session: Session,
    run: TuningRun,
    bucket: BucketRow,
    kernel: str,
    params: dict[str, Any],
    median_us: float | None,
    p20_us: float | None,
    p80_us: float | None,
    samples: int,
    error: float | None,
    status: MeasurementStatus | str,
    reason: str | None = None,
) -> Measurement:
    """Record one trial, whatever its outcome: failures are evidence too.

    Raises:
        ValueError: If an ``ok`` trial has no median time.
    """
    status = MeasurementStatus(status)
    if status is MeasurementStatus.OK and median_us is None:
        raise ValueError(f"an ok measurement of {kernel} needs median_us")
    measurement = Measurement(
        run_id=run.id,
        bucket_id=bucket.id,
        kernel=kernel,
        params=dump_json(params),
        median_us=median_us,
        p20_us=p20_us,
        p80_us=p80_us,
        samples=int(samples),
        error=error,
        status=status,
        reason=reason,
        created_at=utcnow(),
    )
    session.add(measurement)
    session.flush()
    return measurement


def set_winner(
    session: Session,
    sku: SkuRow,
    bucket: BucketRow,
    run: TuningRun,
    kernel: str,
    params: dict[str, Any],
    median_us: float | None,
    p20_us: float | None,
    p80_us: float | None,
    error: float | None,
    baseline_kernel: str,
    baseline_params: dict[str, Any],
    baseline_us: float | None,
    source: str = "measured",
    baselines: Sequence[BaselineRecord] | None = None,
) -> WinnerRow:
    """Insert or replace the winner of (sku, bucket); ``speedup = baseline_us / median_us``.

    ``baselines``: every rule variant timed beside the winner (``WinnerRecord.baselines``); the
    ``baseline_*`` columns hold the one that was the rule where the row was tuned. ``run``: the
    run that measured the winner, which is provenance: a job that re-confirms a winner measured
    by an earlier run passes that run, not its own.

    The replacement is unconditional: deciding that a new result beats the stored one is the
    tuner's job (or ``merge_tables``'s), not storage's. A ``measured`` winner has both times;
    an imported one (``vllm-json``, ``aiter-csv``) has no baseline time, and may have no time.

    Raises:
        ValueError: An unknown ``source``, a time that is not positive and finite, or a
            measured winner without its times.
    """
    if source not in WINNER_SOURCES:
        raise ValueError(f"winner {kernel}: source {source!r} not in {list(WINNER_SOURCES)}")
    required = ("median_us", "baseline_us") if source == "measured" else ()
    for name, value in (("median_us", median_us), ("baseline_us", baseline_us)):
        if value is None and name not in required:
            continue
        if value is None or not (math.isfinite(value) and value > 0):
            raise ValueError(f"winner {kernel}: {name} must be a positive finite time, got {value}")
    speedup = baseline_us / median_us if median_us and baseline_us else None
    query = select(WinnerRow).filter_by(sku_id=sku.id, bucket_id=bucket.id)
    winner = session.scalars(query).one_or_none()
    if winner is None:  # placeholder values, replaced below; another writer may win the insert
        winner = _add_unique(session, WinnerRow(
            sku_id=sku.id, bucket_id=bucket.id, kernel=kernel, params="{}", source=source,
            baseline_kernel=baseline_kernel, baseline_params="{}", run_id=run.id,
            updated_at=utcnow()), query)
    winner.kernel = kernel
    winner.params = dump_json(params)
    winner.source = source
    winner.median_us, winner.p20_us, winner.p80_us = median_us, p20_us, p80_us
    winner.error = error
    winner.baseline_kernel = baseline_kernel
    winner.baseline_params = dump_json(baseline_params)
    winner.baseline_us = baseline_us
    winner.speedup = speedup
    winner.baselines = None if baselines is None else dump_baselines(baselines)
    winner.run_id = run.id
    winner.updated_at = utcnow()
    session.flush()
    return winner


def measured(
    session: Session, sku: SkuRow, bucket: BucketRow
) -> dict[tuple[str, str], Measurement]:
    """Every trial already run for (sku, bucket) in any run, keyed by ``(kernel, params_json)``.

    A resumed job looks candidates up here (params as ``dump_json(params)``) and skips them. When a
    candidate was measured more than once, the newest measurement is the one returned.
    """
    rows = session.scalars(
        select(Measurement)
        .join(TuningRun, Measurement.run_id == TuningRun.id)
        .where(TuningRun.sku_id == sku.id, Measurement.bucket_id == bucket.id)
        .order_by(Measurement.id)
    )
    return {(m.kernel, m.params): m for m in rows}


def _value(value: Any) -> str:
    """A ``str`` enum's value (``Vendor.NVIDIA`` -> ``"nvidia"``), or the string itself."""
    return str(getattr(value, "value", value))
