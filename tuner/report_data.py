"""What ``moetune report`` shows, gathered from one table: its rows per shape with the verdict
serving would reach on the table's own SKU (``row_verdict``), each bucket's floors, its stored
trials, and where the tuning time went. Plain values only: no plotting, no HTML.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import enum
import math
import re
from pathlib import Path
from statistics import geometric_mean
from typing import Any

from moetune import db
from moetune.runtime.dispatcher import row_verdict
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.rules import RuleChoice, rule_variants
from moetune.tuner.presets import PRESETS
from moetune.tuner.roofline import Ceilings, Floors, floors_us
from moetune.tuner.timing import interval_text, readable_bounds


class RowStatus(str, enum.Enum):
    """What serving on the table's SKU does with a row (from ``row_verdict``)."""

    SERVED = "served"
    RULE_KEPT = "rule kept"  # today's rule was not beaten: serving runs the rule's pick
    IMPORTED = "imported"
    STALE = "stale"
    INVALID = "invalid"

    @property
    def faulty(self) -> bool:
        return self in (RowStatus.STALE, RowStatus.INVALID)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One rule variant the winner was timed against, and the winner's speedup over it:
    ``ratio_lo``-``ratio_hi`` its interval over ``rounds`` rounds, ``None`` where the stored one
    says nothing (``readable_bounds``)."""

    label: str
    median_us: float | None
    speedup: float | None
    ratio_lo: float | None
    ratio_hi: float | None
    rounds: int | None

    def interval_text(self) -> str:
        return interval_text(self.ratio_lo, self.ratio_hi, self.rounds)


@dataclasses.dataclass(frozen=True)
class BucketView:
    """One winner row as the report shows it. ``rule``: the rule where the bucket was tuned
    (the row's ``baseline_*``; its speedup is the row's ``speedup``); ``others``: the other
    variants timed beside it. ``trials``: the bucket's stored measurements, oldest first."""

    row: db.WinnerRecord
    status: RowStatus
    reason: str
    rule: Variant | None
    others: tuple[Variant, ...]
    floors: Floors | None
    trials: tuple[dict[str, Any], ...]
    tuning_s: float | None

    @property
    def num_tokens(self) -> int:
        return int(self.row.bucket["num_tokens"])

    @property
    def roofline(self) -> float | None:
        """The winner's fraction of the roofline (roofline time / its time)."""
        return _fraction(self.floors, self.row.median_us)

    @property
    def rule_roofline(self) -> float | None:
        return _fraction(self.floors, self.row.baseline_us)

    def family_bests(self) -> dict[str, float | None]:
        """Each kernel family tried here: its best stored ok time (search timings, not the
        confirmation's), or None where none of its trials passed."""
        best: dict[str, float | None] = {}
        for t in self.trials:
            us = t["median_us"] if t["status"] == "ok" else None
            mine = best.get(t["kernel"])
            best[t["kernel"]] = us if mine is None else mine if us is None else min(mine, us)
        return best

    def search_curve(self) -> list[float | None]:
        """The best ok time known to the search: ``[0]`` the rule's variants (every search
        starts from them, wherever they were stored), then after each other timed trial in
        the order stored. Pruned configurations cost no trial and are left out."""
        rule = {b.candidate.key for b in self.row.baselines}

        def key(t: dict[str, Any]) -> tuple[str, str]:
            return t["kernel"], t["params_json"]

        def ok(t: dict[str, Any]) -> bool:
            return t["status"] == "ok" and t["median_us"] is not None

        best = min((t["median_us"] for t in self.trials if ok(t) and key(t) in rule),
                   default=None)
        curve = [best]
        for t in self.trials:
            if t["status"] == "pruned" or key(t) in rule:
                continue
            if ok(t):
                best = t["median_us"] if best is None else min(best, t["median_us"])
            curve.append(best)
        return curve

    def trials_to_within(self, margin: float = 0.01) -> int | None:
        """Timed trials after the rule's variants until the search came within ``margin`` of
        its final best (0: the rule was already there)."""
        curve = self.search_curve()
        final = curve[-1]
        if final is None:
            return None
        return next(n for n, b in enumerate(curve) if b is not None and b <= final * (1 + margin))


def _fraction(floors: Floors | None, time_us: float | None) -> float | None:
    roof = floors.roofline_us if floors else None
    return roof / time_us if roof and time_us else None


@dataclasses.dataclass(frozen=True)
class ShapeView:
    """Every bucket of one shape (hidden, intermediate, experts, topk, dtype, quant, ...)."""

    label: str
    preset: str | None
    buckets: tuple[BucketView, ...]

    @property
    def title(self) -> str:
        return f"{self.preset}: {self.label}" if self.preset else self.label

    @property
    def name(self) -> str:
        """The preset's name, else the label: what figures call the shape."""
        return self.preset or self.label

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.label.lower()).strip("-")

    def speedups(self) -> list[float]:
        return [b.row.speedup for b in self.buckets if b.row.speedup]

    def geomean_speedup(self) -> float | None:
        return geometric_mean(self.speedups()) if self.speedups() else None

    def rooflines(self) -> list[float]:
        return [b.roofline for b in self.buckets if b.roofline]

    def tuning_s(self) -> float:
        return sum(b.tuning_s or 0.0 for b in self.buckets)


@dataclasses.dataclass(frozen=True)
class RunView:
    """A tuning run with the ceilings the report used for its rows and where they came from."""

    record: db.RunRecord
    ceilings: Ceilings | None
    ceilings_source: str
    trials: dict[str, int]
    buckets: int
    wall_s: float | None


@dataclasses.dataclass(frozen=True)
class ReportData:
    path: str
    schema_revision: str
    skus: list[dict[str, Any]]
    environment: dict[str, Any]
    shapes: tuple[ShapeView, ...]
    runs: tuple[RunView, ...]
    bad_rows: tuple[str, ...]
    measurements: int
    generated_at: datetime.datetime

    @property
    def buckets(self) -> list[BucketView]:
        return [b for s in self.shapes for b in s.buckets]


def load_report(table: str | Path, ceilings: Ceilings | None = None, *,
                every_run: bool = False) -> ReportData:
    """Read everything the report shows from ``table``.

    Args:
        table: A table file or database URL.
        ceilings: Ceilings for the runs that recorded none (``--ceilings``).
        every_run: ``ceilings`` for every run, also those that measured their own: rows tuned
            on different days then share one floor. A run's own measurement moves with the
            machine's load (the H200 runs of the shipped table measured 4.05-4.40 TB/s and
            728-791 bf16 TFLOP/s), and a floor from a low one makes its rows look nearer the
            roofline.

    Raises:
        TableError: If the table cannot be read.
    """
    snapshot = db.read_winners(table)
    measurements = db.read_measurements(table)
    runs = db.read_runs(table)
    by_bucket: dict[tuple, list[dict[str, Any]]] = collections.defaultdict(list)
    for m in measurements:
        by_bucket[_key(m["sku"], m["bucket"])].append(m)
    run_ceilings = {r.id: (ceilings, "given on the command line, for every run")
                    if every_run and ceilings else _ceilings_of(r, ceilings) for r in runs}
    seconds = _bucket_seconds(measurements, runs)
    views = [_bucket_view(row, by_bucket.get(_key(row.sku, row.bucket), []),
                          run_ceilings.get(row.run_id, (None, ""))[0],
                          seconds.get(_key(row.sku, row.bucket)))
             for row in snapshot.rows]
    shapes: dict[str, list[BucketView]] = collections.defaultdict(list)
    for v in views:
        shapes[shape_label(v.row.bucket)].append(v)
    shape_views = sorted((ShapeView(label, _preset_of(bs[0].row.bucket),
                                    tuple(sorted(bs, key=lambda b: b.num_tokens)))
                          for label, bs in shapes.items()),
                         key=lambda s: (s.preset is None, s.preset or "", s.label))
    run_views = tuple(_run_view(r, run_ceilings[r.id], measurements) for r in runs)
    return ReportData(str(db.display_url(table) if db.is_url(table) else table),
                      snapshot.schema_revision, snapshot.skus, snapshot.environment,
                      tuple(shape_views), run_views, tuple(snapshot.bad_rows), len(measurements),
                      datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0))


def duration(seconds: float) -> str:
    """``4 min 07 s``, or ``38 s``."""
    minutes, s = divmod(int(math.floor(seconds + 0.5)), 60)
    return f"{minutes} min {s:02d} s" if minutes else f"{s} s"


def _key(sku: dict[str, Any], bucket: dict[str, Any]) -> tuple:
    return (sku["vendor"], sku["name"], sku["arch"], *sorted(bucket.items()))


def shape_label(b: dict[str, Any]) -> str:
    """``H4096 I14336 E8 k2 bfloat16 none silu`` (plus ``ungated`` / ``tkw-in``)."""
    return (f"H{b['hidden_size']} I{b['intermediate_size']} E{b['num_experts']} "
            f"k{b['topk']} {b['dtype']} {b['quant']} {b['activation']}"
            f"{'' if b['gated'] else ' ungated'}{' tkw-in' if b['router_weight_on_input'] else ''}")


def _preset_of(bucket: dict[str, Any]) -> str | None:
    shape = {k: v for k, v in bucket.items() if k != "num_tokens"}
    for name, p in PRESETS.items():
        row = p.shape.problem(1).to_row()
        del row["num_tokens"]
        if row == shape:
            return name
    return None


def sku_of(row_sku: dict[str, Any]) -> SKU:
    """The SKU a row was tuned on: the report judges every row as serving there would.

    Raises:
        ValueError: An unknown vendor.
    """
    return SKU(Vendor(row_sku["vendor"]), row_sku["name"], row_sku["arch"],
               int(row_sku["compute_units"]), int(row_sku["memory_bytes"]))


def _bucket_view(row: db.WinnerRecord, trials: list[dict[str, Any]], ceilings: Ceilings | None,
                 tuning_s: float | None) -> BucketView:
    try:
        sku = sku_of(row.sku)
    except ValueError as e:
        return BucketView(row, RowStatus.INVALID, f"unknown SKU: {e}", None, (), None,
                          tuple(trials), tuning_s)
    verdict = row_verdict(row, sku)
    if verdict.selection is None:
        status = RowStatus.STALE if verdict.stale else RowStatus.INVALID
    elif row.source != "measured":
        status = RowStatus.IMPORTED
    elif verdict.rule_kept:
        status = RowStatus.RULE_KEPT
    else:
        status = RowStatus.SERVED
    problem = verdict.problem
    rules = rule_variants(problem, sku) if problem is not None else ()
    variants = [_variant(b, row, rules, i == 0) for i, b in enumerate(row.baselines)]
    floors = floors_us(problem, ceilings) if problem is not None and ceilings else None
    return BucketView(row, status, verdict.reason, variants[0] if variants else None,
                      tuple(variants[1:]), floors, tuple(trials), tuning_s)


def _variant(b: db.BaselineRecord, row: db.WinnerRecord, rules: tuple[RuleChoice, ...],
             tuned: bool) -> Variant:
    """``b`` as the report shows it, named as the rule variant it stands for here;
    ``tuned``: it is the rule where the row was tuned, whose speedup the row stores."""
    label = next((_variant_label(v.reason) for v in rules if b.stands_for(v)),
                 f"{b.candidate} (not a rule variant here)")
    us = b.median_us
    speedup = row.speedup if tuned else us / row.median_us if us and row.median_us else None
    lo, hi = readable_bounds(b.ratio_lo, b.ratio_hi, b.rounds) or (None, None)
    return Variant(label, us, speedup, lo, hi, b.rounds)


def _variant_label(reason: str) -> str:
    """``CUDA rule: vLLM's fused-MoE Triton kernel with its tuned config F.json, entry M=8``
    -> ``vLLM's tuned config F.json``: what the variant is, the same for every bucket."""
    text = reason.split(": ", 1)[-1]
    text = text.split(" with ", 1)[-1]
    text = re.sub(r", entry M=\d+", "", text)
    text = text.replace(" (vLLM has no tuned file for this shape and GPU)", "")
    return re.sub(r"^its ", "vLLM's ", text)


def _ceilings_of(run: db.RunRecord, given: Ceilings | None) -> tuple[Ceilings | None, str]:
    """The ceilings for a run's rows, and where they came from."""
    if run.ceilings is not None:
        try:
            return Ceilings.from_dict(run.ceilings), "measured when the run started"
        except ValueError as e:
            why = f"recorded ceilings unreadable ({e})"
            return (given, f"{why}; given on the command line") if given else (None, why)
    if given is not None:
        return given, "given on the command line, the run recorded none"
    return None, "none recorded (CPU run, or tuned before moetune recorded them)"


def _bucket_seconds(measurements: list[dict[str, Any]],
                    runs: list[db.RunRecord]) -> dict[tuple, float]:
    """Wall seconds per bucket: a job writes each bucket's trials when the bucket is done, so
    a bucket's time runs from the previous write of its run (or the run's start) to its own.
    Buckets tuned in several runs add up."""
    starts = {r.id: r.started_at for r in runs}
    writes: dict[tuple[int, tuple], datetime.datetime] = {}
    for m in measurements:
        at = datetime.datetime.fromisoformat(m["created_at"])
        k = (m["run_id"], _key(m["sku"], m["bucket"]))
        writes[k] = max(writes.get(k, at), at)
    seconds: dict[tuple, float] = collections.defaultdict(float)
    last: dict[int, datetime.datetime] = {}
    for (run_id, key), at in sorted(writes.items(), key=lambda kv: kv[1]):
        before = last.get(run_id, starts.get(run_id, at))
        seconds[key] += max(0.0, (at - before).total_seconds())
        last[run_id] = at
    return dict(seconds)


def _run_view(run: db.RunRecord, ceilings: tuple[Ceilings | None, str],
              measurements: list[dict[str, Any]]) -> RunView:
    mine = [m for m in measurements if m["run_id"] == run.id]
    trials = dict(collections.Counter(m["status"] for m in mine))
    buckets = len({_key(m["sku"], m["bucket"]) for m in mine})
    end = run.finished_at or max((datetime.datetime.fromisoformat(m["created_at"])
                                  for m in mine), default=None)
    wall = (end - run.started_at).total_seconds() if end else None
    return RunView(run, ceilings[0], ceilings[1], trials, buckets, wall)
