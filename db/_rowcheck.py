"""The data-level check of a winner row, applied as it is read, before any command or serving
sees it.

A table file is data anyone can edit: SQLite stores whatever type a column is given, and a
hand edit, a bad tool or a damaged disk can leave a time negative, a reference dangling or a
JSON field nested a million levels deep. ``read_snapshot`` runs every row through
``winner_fault``; a row it refuses is one of ``TableSnapshot.bad_winners`` with the reason,
which serving skips (falling back to the rule), ``show`` flags, ``export``, ``merge`` and
``import`` drop with a line, and ``--strict`` refuses. What only the runtime can judge (the
bucket as a MoE problem, the kernel and its params' space) is ``runtime._verdict.row_problem``.
"""

import datetime
import math
from collections.abc import Mapping
from typing import Any

from moetune.db._baselines import SCHEMA, BaselineRecord, _number, _positive, _short
from moetune.db._jsontext import load_json
from moetune.db._models import WINNER_SOURCES, RunStatus

#: ``speedup`` is written as ``baseline_us / median_us``; a stored one further off was edited.
SPEEDUP_RTOL = 1e-6
#: Rule variants one row may list (a bucket is timed against a handful).
MAX_BASELINES = 64
_BUCKET_TEXT = frozenset({"dtype", "quant", "activation"})
_BUCKET_FLAGS = frozenset({"gated", "router_weight_on_input"})


def winner_fault(row: Mapping[str, Any]) -> str | None:
    """Why the winner ``row`` (its stored columns by name) cannot be used, or None.

    Checks, in order: the kernel names are non-empty text, ``source`` is one of
    ``WINNER_SOURCES``, every time is a finite positive number (NULL only where the source has
    none: vLLM files have no time, imports no baseline time), ``p20_us <= median_us <=
    p80_us``, ``speedup`` equals ``baseline_us / median_us``, ``error`` is finite and not
    negative, and ``updated_at`` and its run's ``run_started_at``, ``run_finished_at`` (may be
    NULL) and ``run_status`` are of their types as stored (a copy converts them). References
    and JSON are checked by the reader (``read_snapshot``).
    """
    for name in ("kernel", "baseline_kernel"):
        if not isinstance(row[name], str) or not row[name]:
            return f"{name} is not a kernel name: {_short(row[name])}"
    source = row["source"]
    if source not in WINNER_SOURCES:
        return f"source {_short(source)} is not one of {', '.join(WINNER_SOURCES)}"
    required = {"measured": ("median_us", "p20_us", "p80_us", "baseline_us", "speedup"),
                "aiter-csv": ("median_us",)}.get(source, ())
    for name in ("median_us", "p20_us", "p80_us", "baseline_us", "speedup"):
        value = row[name]
        if value is None:
            if name in required:
                return f"{name} is missing, which a {source} row must have"
        elif not _positive(value):
            return f"{name} is {_short(value)}, not a finite positive number"
    median, p20, p80 = row["median_us"], row["p20_us"], row["p80_us"]
    if None not in (median, p20, p80) and not p20 <= median <= p80:
        return f"times out of order: p20 {p20:g}, median {median:g}, p80 {p80:g} us"
    speedup, baseline = row["speedup"], row["baseline_us"]
    if speedup is not None and (median is None or baseline is None):
        return f"speedup {speedup:g} without the times it follows from"
    if speedup is not None and not math.isclose(speedup, baseline / median, rel_tol=SPEEDUP_RTOL):
        return (f"speedup {speedup:g} does not follow from the times (baseline {baseline:g} us "
                f"/ median {median:g} us = {baseline / median:g})")
    error = row["error"]
    if error is not None and not (_number(error) and math.isfinite(error) and error >= 0):
        return f"error is {_short(error)}, not a finite non-negative number"
    for name in ("updated_at", "run_started_at", "run_finished_at"):
        if not _stamp(row[name], nullable=name == "run_finished_at"):
            return f"{name} is {_short(row[name])}, not a date and time"
    if row["run_status"] not in {s.value for s in RunStatus}:
        return f"its run's status {_short(row['run_status'])} is not one of " + ", ".join(
            s.value for s in RunStatus)
    return None


def bucket_fault(bucket: Mapping[str, Any]) -> str | None:
    """Why a winner's bucket columns are not even of their types (sizes integers, dtype,
    quant and activation text), or None. Whether they describe a MoE problem is the
    runtime's question (``MoEProblem.from_row``)."""
    for name, value in bucket.items():
        kind = str if name in _BUCKET_TEXT else bool if name in _BUCKET_FLAGS else int
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"bucket column {name} is {_short(value)}, not {kind.__name__}"
    return None


def parse_baselines(text: object) -> tuple[BaselineRecord, ...]:
    """The rule variants of a row's ``baselines`` column, each checked
    (``BaselineRecord.from_json``); text without a ``schema`` key is schema 1.

    Raises:
        ValueError: The text is not ``{"variants": [...]}`` (within ``load_json``'s bounds) of
            a schema this moetune reads, or a variant is not one (the message names it).
    """
    value = load_json(text)
    schema, variants = value.get("schema", 1), value.get("variants")
    if schema not in (1, SCHEMA) or isinstance(schema, bool):
        raise ValueError(f"schema {_short(schema)} is not one this moetune reads (1 or {SCHEMA})")
    if not isinstance(variants, list) or len(variants) > MAX_BASELINES:
        raise ValueError(f"expected a list of at most {MAX_BASELINES} variants")
    records = []
    for i, v in enumerate(variants):
        try:
            records.append(BaselineRecord.from_json(v, schema))
        except ValueError as e:
            raise ValueError(f"variant {i}: {e}") from None
    return tuple(records)


def _stamp(value: object, nullable: bool) -> bool:
    """A stored date and time: a datetime (a server's driver converts), or ISO 8601 text."""
    if value is None or isinstance(value, datetime.datetime):
        return value is not None or nullable
    try:
        datetime.datetime.fromisoformat(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True
