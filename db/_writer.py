"""What a tuning job or an import writes to a table, and reads back to decide what to write.

A ``TableWriter`` owns every session and ORM row, so its callers deal in plain values: SKU and
bucket key dicts (``SKU.to_row()``, ``MoEProblem.to_row()``) and the frozen records below.
Each write is one ``write_table`` (copy, write, atomic replace for a file; one transaction on a
server) made under the writer's own lock, so the threads of one job never write at once and a
bucket's measurements land with its winner or not at all.
"""

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from moetune.db._baselines import BaselineRecord
from moetune.db._files import claim_in, open_table, write_table
from moetune.db._jsontext import json_or_none, load_json
from moetune.db._models import BucketRow, MeasurementStatus, RunStatus, SkuRow, TuningRun
from moetune.db._read import WinnerRecord, read_winners
from moetune.db._schema import file_path, is_url
from moetune.db._tuning import (
    add_measurement,
    find_bucket,
    find_sku,
    finish_run,
    get_or_create_bucket,
    get_or_create_sku,
    get_run,
    measured,
    set_winner,
    start_run,
)


@dataclasses.dataclass(frozen=True)
class MeasurementRecord:
    """One trial of a candidate, whatever its outcome (failures are evidence too); ``run_id``
    is the run that made it and ``environment`` the versions that run recorded (None when
    unreadable), known when read back."""

    kernel: str
    params: dict[str, Any]
    status: MeasurementStatus
    median_us: float | None = None
    p20_us: float | None = None
    p80_us: float | None = None
    samples: int = 0
    error: float | None = None
    reason: str | None = None
    run_id: int | None = None
    environment: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class WinnerEntry:
    """A bucket's winner as it is set (``set_winner``; the speedup follows from the times)."""

    kernel: str
    params: dict[str, Any]
    median_us: float | None
    p20_us: float | None
    p80_us: float | None
    error: float | None
    baseline_kernel: str
    baseline_params: dict[str, Any]
    baseline_us: float | None
    source: str = "measured"
    baselines: tuple[BaselineRecord, ...] | None = None


class TableWriter:
    """The table at ``target`` (a file or a server URL), as its writers see it."""

    def __init__(self, target: str | Path) -> None:
        self.target = target
        self._lock = threading.Lock()

    def start_run(self, sku: dict[str, Any], *, environment: dict[str, Any], command: str,
                  commit: str | None, driver: str | None,
                  ceilings: dict[str, float] | None = None) -> int:
        """Record a run starting in this process on ``sku`` (``start_run``); its id."""
        with self._session() as s:
            return start_run(s, get_or_create_sku(s, **sku), environment=environment,
                             command=command, commit=commit, driver=driver,
                             ceilings=ceilings).id

    def finish_run(self, run_id: int, status: RunStatus) -> None:
        """Mark run ``run_id`` finished or failed.

        Raises:
            TableError: the run is gone (another program replaced the file).
        """
        with self._session() as s:
            finish_run(s, get_run(s, run_id), status)

    def claim(self, name: str) -> contextlib.AbstractContextManager[bool]:
        """The claim ``name`` while this job works on it: yields whether no other job holds it
        (``claim_in``)."""
        return claim_in(self.target, name)

    def winners(self) -> list[WinnerRecord]:
        """The table's winners now; none while the file does not exist yet."""
        return read_winners(self.target).rows if self._exists() else []

    def measurements(self, sku: dict[str, Any],
                     bucket: dict[str, Any]) -> dict[tuple[str, str], MeasurementRecord]:
        """Every trial earlier runs made for ``bucket`` on ``sku``, the newest of each, keyed by
        ``(kernel, dump_json(params))``. Read-only: another job may be replacing the file."""
        if not self._exists():
            return {}
        with open_table(self.target) as table, table.session() as s:
            sku_row = find_sku(s, sku["vendor"], sku["name"], sku["arch"], sku["compute_units"])
            bucket_row = find_bucket(s, **bucket)
            rows = measured(s, sku_row, bucket_row) if sku_row and bucket_row else {}
            run_ids = {m.run_id for m in rows.values()}
            runs = {run_id: json_or_none(text) for run_id, text in s.execute(
                select(TuningRun.id, TuningRun.environment).where(TuningRun.id.in_(run_ids)))}
            return {key: MeasurementRecord(m.kernel, load_json(m.params), m.status, m.median_us,
                                           m.p20_us, m.p80_us, m.samples, m.error, m.reason,
                                           m.run_id, runs.get(m.run_id))
                    for key, m in rows.items()}

    def publish_bucket(self, run_id: int, sku: dict[str, Any], bucket: dict[str, Any],
                       measurements: Iterable[MeasurementRecord], winner: WinnerEntry, *,
                       found_by: int | None = None) -> None:
        """Add run ``run_id``'s new ``measurements`` of ``bucket`` and set its winner on ``sku``,
        in one write. ``found_by``: the earlier run that measured the winner (its provenance),
        when this run re-confirmed it.

        Raises:
            TableError: a run is gone (another program replaced the file).
        """
        with self._session() as s:
            run = get_run(s, run_id)
            bucket_row = get_or_create_bucket(s, **bucket)
            for m in measurements:
                add_measurement(s, run, bucket_row, m.kernel, m.params, m.median_us, m.p20_us,
                                m.p80_us, m.samples, m.error, m.status, m.reason)
            found = get_run(s, run_id if found_by is None else found_by)
            _set_winner(s, get_or_create_sku(s, **sku), bucket_row, found, winner)

    def import_winners(self, winners: Iterable[tuple[dict[str, Any], dict[str, Any],
                                                     WinnerEntry]], *,
                       environment: dict[str, Any], command: str) -> None:
        """Write ``(sku, bucket, winner)`` triples from another tool in one write, as one
        finished run per SKU that ``command`` names; no measurements (nothing moetune can
        time again)."""
        with self._session() as s:
            runs: dict[tuple[Any, ...], tuple[SkuRow, TuningRun]] = {}
            for sku, bucket, winner in winners:
                key = tuple(sorted(sku.items()))
                if key not in runs:
                    sku_row = get_or_create_sku(s, **sku)
                    runs[key] = sku_row, start_run(s, sku_row, environment, command, None, None)
                sku_row, run = runs[key]
                _set_winner(s, sku_row, get_or_create_bucket(s, **bucket), run, winner)
            for _, run in runs.values():
                finish_run(s, run, RunStatus.FINISHED)

    @contextlib.contextmanager
    def _session(self) -> Iterator[Session]:
        with self._lock, write_table(self.target) as table, table.session() as s:
            yield s

    def _exists(self) -> bool:
        return is_url(self.target) or file_path(self.target).exists()


def _set_winner(session: Session, sku: SkuRow, bucket: BucketRow, run: TuningRun,
                w: WinnerEntry) -> None:
    set_winner(session, sku, bucket, run, w.kernel, w.params, w.median_us, w.p20_us, w.p80_us,
               w.error, w.baseline_kernel, w.baseline_params, w.baseline_us, source=w.source,
               baselines=w.baselines)
