"""Human-readable views of tables, lookups, tuning outcomes and the platform."""

from __future__ import annotations

import json
from typing import Any

from rich.table import Table

from moetune import db
from moetune.runtime.dispatcher import Dispatcher, Selection
from moetune.runtime.platform import SKU, environment
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import Registry
from moetune.runtime.rules import rule_choice
from moetune.tuner.job import BucketOutcome


def winner_dicts(snapshot: db.TableSnapshot) -> list[dict[str, Any]]:
    """One flat dict per winner row (``moetune show --json``)."""
    rows = []
    for r in snapshot.rows:
        rows.append({**r.bucket, "sku": r.sku["name"], "arch": r.sku["arch"],
                     "kernel": r.kernel, "params": r.params, "median_us": r.median_us,
                     "p20_us": r.p20_us, "p80_us": r.p80_us, "error": r.error,
                     "baseline_kernel": r.baseline_kernel, "baseline_params": r.baseline_params,
                     "baseline_us": r.baseline_us, "speedup": r.speedup, "run_id": r.run_id,
                     "source": r.source})
    return rows


def winners_table(snapshot: db.TableSnapshot) -> Table:
    skus = ", ".join(f"{s['vendor']}:{s['name']} ({s['arch']})" for s in snapshot.skus)
    table = Table(title=f"{snapshot.path} — {skus or 'empty'}")
    for col in ("shape", "tokens", "winner", "params", "time us", "baseline", "base us",
                "speedup", "rel err"):
        table.add_column(col, justify="right" if col in ("tokens", "time us", "base us",
                                                         "speedup", "rel err") else "left")
    for r in sorted(snapshot.rows, key=lambda r: (_shape_label(r.bucket), r.bucket["num_tokens"])):
        table.add_row(_shape_label(r.bucket), str(r.bucket["num_tokens"]), r.kernel,
                      json.dumps(r.params, sort_keys=True) if r.params else "-",
                      _num(r.median_us, ".1f"), r.baseline_kernel, _num(r.baseline_us, ".1f"),
                      _num(r.speedup, ".2f", "x"), _num(r.error, ".1e"))
    for bad in snapshot.bad_rows:
        table.add_row("[red]rejected[/red]", "", bad, "", "", "", "", "", "")
    return table


def _shape_label(b: dict[str, Any]) -> str:
    return (f"H{b['hidden_size']} I{b['intermediate_size']} E{b['num_experts']} "
            f"k{b['topk']} {b['dtype']} {b['quant']} {b['activation']}"
            f"{'' if b['gated'] else ' ungated'}{' tkw-in' if b['router_weight_on_input'] else ''}")


def _num(value: float | None, spec: str, unit: str = "") -> str:
    """A table cell: ``-`` where an imported row has no such number."""
    return "-" if value is None else f"{value:{spec}}{unit}"


def outcome_line(o: BucketOutcome) -> str:
    head = f"M={o.problem.num_tokens:<5}" + (f" [{o.device}]" if o.device else "")
    if o.skipped:
        return f"{head} skipped: {o.skipped}"
    if o.decision is None:
        return f"{head} [red]failed[/red]: {o.error}"
    d = o.decision
    return (f"{head} {d.winner.kernel} {json.dumps(d.winner.params) if d.winner.params else ''} "
            f"{d.winner_timing.median_us:.1f}us vs {d.baseline.kernel} "
            f"{d.baseline_timing.median_us:.1f}us ({d.reason}); {o.measured} measured, "
            f"{o.reused} reused{_phases(o.seconds)}")


def _phases(seconds: dict[str, float]) -> str:
    if not seconds:
        return ""
    parts = ", ".join(f"{name.replace('_', ' ')} {s:.0f}" for name, s in seconds.items()
                      if name != "total" and s >= 0.5)
    return f"; {seconds['total']:.0f}s ({parts})"


def lookup_text(problem: MoEProblem, dispatcher: Dispatcher, s: Selection) -> str:
    lines = [f"problem: {problem.describe()}",
             f"table:   {dispatcher.status.path or '-'} ({dispatcher.status.reason})",
             f"pick:    {s.kernel} {json.dumps(s.params) if s.params else ''}",
             f"source:  {s.source}", f"why:     {s.reason}"]
    if s.source == "table":
        lines.append(f"tuned:   {s.median_us:.1f}us, {s.speedup:.2f}x over the rule"
                     if s.median_us is not None and s.speedup is not None else
                     f"tuned:   {_num(s.median_us, '.1f', 'us')} (imported: no speedup measured)")
    return "\n".join(lines)


def doctor_text(sku: SKU, registry: Registry, problem: MoEProblem) -> str:
    env = environment()
    lines = [f"device:  {sku.label()}, {sku.memory_bytes / 2**30:.0f} GiB",
             "software: " + ", ".join(f"{k} {v}" for k, v in env.items() if v),
             f"rule:    {rule_choice(problem, sku).reason}",
             f"kernels for {problem.describe()}:"]
    for name, why in registry.eligibility(problem, sku).items():
        lines.append(f"  {name:<34} {'eligible' if why is None else 'no: ' + why}")
    return "\n".join(lines)


def merge_text(r: db.MergeReport) -> str:
    lines = [f"merged into {r.output}: {r.rows} winners, {len(r.conflicts)} conflicts"]
    lines += [f"  {c}" for c in r.conflicts]
    return "\n".join(lines)
