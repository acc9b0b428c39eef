"""Human-readable views of tables, lookups, tuning outcomes and the platform."""

from __future__ import annotations

import json
from statistics import geometric_mean
from typing import Any

from rich.table import Table

from moetune import db
from moetune.runtime.dispatcher import Dispatcher, default_table, row_verdict, shipped_table
from moetune.runtime.kernels.base import BaseKernel
from moetune.runtime.plan import Outcome, ShapePlan, nondeterministic
from moetune.runtime.platform import SKU, Vendor, environment
from moetune.runtime.problem import DType, MoEProblem
from moetune.runtime.registry import Registry, default_registry
from moetune.runtime.rules import is_rule_pick, rule_choice
from moetune.runtime.vllm import versions
from moetune.runtime.vllm.cpu import fp8_experts_class
from moetune.tuner.adopt import outdated
from moetune.tuner.bucket import BucketOutcome
from moetune.tuner.timing import interval_text


def winner_dicts(snapshot: db.TableSnapshot, sku: SKU, aside: str | None = None,
                 deterministic: bool = False) -> list[dict[str, Any]]:
    """One flat dict per winner row (``moetune show --json``), with the vLLM whose pick its
    speedup is over (``baseline_vllm``), and whether serving on ``sku`` here, under these
    versions and the settings ``aside`` and ``deterministic`` (``_served``; the defaults: none
    in force), uses it (``served``) and why (``served_reason``); unreadable rows have
    ``bad_row``."""
    rows = []
    here = environment()
    for r in snapshot.rows:
        served, why = _served(r, sku, here, aside, deterministic)
        rows.append({**r.bucket, "sku": r.sku["name"], "arch": r.sku["arch"],
                     "kernel": r.kernel, "params": r.params, "median_us": r.median_us,
                     "p20_us": r.p20_us, "p80_us": r.p80_us, "error": r.error,
                     "baseline_kernel": r.baseline_kernel, "baseline_params": r.baseline_params,
                     "baseline_us": r.baseline_us, "speedup": r.speedup,
                     "baseline_vllm": _tuned_vllm(r), "run_id": r.run_id, "source": r.source,
                     "baselines": [b.to_json() for b in r.baselines],
                     "served": served, "served_reason": why})
    return rows + [{"bad_row": bad, "served": False, "served_reason": bad}
                   for bad in snapshot.bad_rows]


def winners_table(snapshot: db.TableSnapshot, sku: SKU, aside: str | None = None,
                  deterministic: bool = False) -> Table:
    """The winners as a grid, each marked served on ``sku`` here or why not, under the settings
    ``aside`` and ``deterministic`` (``_served``; the defaults: none in force)."""
    skus = ", ".join(f"{s['vendor']}:{s['name']} ({s['arch']})" for s in snapshot.skus)
    table = Table(title=f"{snapshot.path} — {skus or 'empty'}; served here ({sku.label()})?")
    for col in ("shape", "tokens", "winner", "params", "time us", "baseline", "base us",
                "speedup", "over vLLM", "rel err", "served here"):
        table.add_column(col, justify="right" if col in ("tokens", "time us", "base us",
                                                         "speedup", "rel err") else "left")
    here = environment()
    for r in sorted(snapshot.rows, key=lambda r: (_shape_label(r.bucket), r.bucket["num_tokens"])):
        served, why = _served(r, sku, here, aside, deterministic)
        table.add_row(_shape_label(r.bucket), str(r.bucket["num_tokens"]), r.kernel,
                      json.dumps(r.params, sort_keys=True) if r.params else "-",
                      _num(r.median_us, ".1f"), r.baseline_kernel, _num(r.baseline_us, ".1f"),
                      _num(r.speedup, ".2f", "x"), _tuned_vllm(r) or "-", _num(r.error, ".1e"),
                      "yes" if served else f"[red]no[/red]: {why}")
    for bad in snapshot.bad_rows:
        table.add_row("[red]rejected[/red]", "", bad, "", "", "", "", "", "", "", "[red]no[/red]")
    return table


def _served(row: db.WinnerRecord, sku: SKU, here: dict[str, Any], aside: str | None,
            deterministic: bool) -> tuple[bool, str]:
    """Whether serving on ``sku`` under the versions ``here`` uses ``row``, and why (not): the
    row's own verdict (``row_verdict``), unless the plugin hooks no layer (``aside`` says why:
    ``MOETUNE_MODE=off``, or the installed vLLM is not one it serves or asks for batch
    invariance) or, with ``deterministic`` (``MOETUNE_DETERMINISTIC=1``), the winner's bits
    may change between calls and it is not the rule's pick, as ``ShapePlan.build`` refuses
    it."""
    if aside:
        return False, f"moetune hooks no layer: {aside}"
    verdict = row_verdict(row, sku, environment=here)
    chosen = verdict.selection
    if chosen is None:
        return False, verdict.reason
    if deterministic and verdict.problem is not None and not is_rule_pick(
            chosen.kernel, chosen.params, verdict.problem, sku):
        varies = nondeterministic(default_registry.get(chosen.kernel), verdict.problem,
                                  chosen.params)
        if varies:
            return False, varies
    return True, verdict.reason


def _tuned_vllm(row: db.WinnerRecord) -> str | None:
    """The vLLM version whose pick the row's speedup is over; None where it is over no
    vLLM's (the torch loop) or the row was imported."""
    return row.tuned_against.vllm if row.tuned_against else None


def speedup_markdown(snapshot: db.TableSnapshot, sku: SKU) -> str:
    """Per shape and bucket: the winner, each rule variant it was timed against (vLLM's
    tuned-file pick and its default config on CUDA) with the speedup over it, and whether
    serving on ``sku`` uses the row. The results page of a tuning run."""
    lines = []
    rows = sorted(snapshot.rows, key=lambda r: (_shape_label(r.bucket), r.bucket["num_tokens"]))
    for label in dict.fromkeys(_shape_label(r.bucket) for r in rows):
        shape_rows = [r for r in rows if _shape_label(r.bucket) == label]
        lines += [f"### {label}", "",
                  "| M | winner | us | vLLM's pick here | its us | speedup (interval) | "
                  "other variants: us, speedup | served |",
                  "|---|---|---|---|---|---|---|---|"]
        gains = []
        for r in shape_rows:
            problem = MoEProblem.from_row(r.bucket)
            rule = rule_choice(problem, sku)
            pick = next((b for b in r.baselines if b.stands_for(rule)), None)
            others = [b for b in r.baselines if b is not pick]
            verdict = row_verdict(r, sku)
            if pick is not None and pick.median_us and r.median_us:
                gains.append(pick.median_us / r.median_us)
            lines.append("| {} | {} | {} | {} | {} | {} | {} | {} |".format(
                r.bucket["num_tokens"], r.kernel, _num(r.median_us, ".1f"),
                rule.reason.split(" with ")[-1],
                _num(pick and pick.median_us, ".1f"),
                "-" if pick is None or not pick.median_us or not r.median_us else
                f"{pick.median_us / r.median_us:.3f}x ("
                f"{interval_text(pick.ratio_lo, pick.ratio_hi, pick.rounds)})",
                "; ".join(f"{b.median_us:.1f}, {b.median_us / r.median_us:.3f}x"
                          for b in others if b.median_us and r.median_us) or "-",
                "yes" if verdict.selection is not None else f"no: {verdict.reason}"))
        if gains:
            lines += ["", f"Geomean speedup over vLLM's pick: {geometric_mean(gains):.3f}x "
                          f"over {len(gains)} buckets (min {min(gains):.3f}x, max "
                          f"{max(gains):.3f}x).", ""]
    return "\n".join(lines)


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
    how = (f"run {o.reconfirmed}'s winner re-timed, no search" if o.reconfirmed is not None
           else f"{o.reused} reused")
    return (f"{head} {d.winner.kernel} {json.dumps(d.winner.params) if d.winner.params else ''} "
            f"{d.winner_timing.median_us:.1f}us vs {d.baseline.kernel} "
            f"{d.baseline_timing.median_us:.1f}us ({d.reason}); {o.measured} measured, "
            f"{how}{_phases(o.seconds)}")


def _phases(seconds: dict[str, float]) -> str:
    if not seconds:
        return ""
    parts = ", ".join(f"{name.replace('_', ' ')} {s:.0f}" for name, s in seconds.items()
                      if name != "total" and s >= 0.5)
    return f"; {seconds['total']:.0f}s ({parts})"


def lookup_text(problem: MoEProblem, dispatcher: Dispatcher, plan: ShapePlan,
                aside: str | None = None) -> str:
    """What serving runs for ``problem``: read from the plan vLLM's plugin builds for its shape
    (``ShapePlan.build``), so lookup and the engine cannot disagree; where the plugin hooks no
    layer (``aside`` says why: the settings turn it off, or the installed vLLM is not one it
    serves, or asks for batch invariance), vLLM's."""
    if aside:
        return "\n".join([f"problem: {problem.describe()}",
                          f"table:   {dispatcher.status.path or '-'} ({dispatcher.status.reason})",
                          "pick:    vLLM's own kernel (moetune hooks no layer)",
                          "source:  vLLM",
                          f"why:     {aside}"])
    choice, _ = plan.lookup(problem.num_tokens)
    bucket = plan.bucket(problem.num_tokens)
    rule = rule_choice(problem, dispatcher.sku)
    pick = (f"{choice.kernel} {json.dumps(choice.params) if choice.params else ''}".rstrip()
            if choice.kernel is not None else f"vLLM's own kernel ({rule.kernel})")
    if choice.engine:
        pick += " (vLLM's own experts apply, run inside this setting)"
    why = choice.reason if dispatcher.usable else "table not used here (see above)"
    lines = [f"problem: {problem.describe()}",
             f"table:   {dispatcher.status.path or '-'} ({dispatcher.status.reason})",
             f"pick:    {pick}",
             f"source:  {'table' if choice.outcome is Outcome.HIT else 'rule'}",
             f"counted: {choice.outcome.value}"
             + (f" (the table's bucket M={bucket})" if bucket is not None else ""),
             f"why:     {why}"]
    if choice.outcome is Outcome.HIT and bucket is not None:
        s = dispatcher.select(plan.shape.problem(bucket), plan.layout)
        lines.append(f"tuned:   {s.median_us:.1f}us, {s.speedup:.2f}x over the rule"
                     if s.median_us is not None and s.speedup is not None else
                     f"tuned:   {_num(s.median_us, '.1f', 'us')} (imported: no speedup measured)")
    if choice.kernel is not None and bucket is not None:
        varies = dispatcher.registry.get(choice.kernel).run_to_run(
            plan.shape.problem(bucket), choice.params)
        lines.append(f"repeats: {varies or 'the same bits in every call'}")
    if choice.kernel is None:
        lines.append(f"rule:    {rule.reason}")
    elif not choice.engine and not dispatcher.registry.get(choice.kernel).skips_unrouted \
            and (facts := versions.facts_of(versions.installed())) is not None \
            and versions.unrouted_rows(facts):
        lines.append("padding: slots vLLM routes nowhere (rows of a batch padded to a CUDA "
                     "graph's size) go to expert 0 at weight 0 first, in one launch")
    return "\n".join(lines)


def doctor_text(sku: SKU, registry: Registry, problem: MoEProblem) -> str:
    """The device, the versions here, whether the table serving uses by default (adopted or
    shipped) is used here (and why not), the rule, and every family ``registry`` holds: whether
    it is eligible for ``problem`` (and why not), and if so what tuning does with it."""
    env = environment()
    path = default_table(sku)
    table = (f"{path} ({Dispatcher.load(path, sku, registry=registry).status.reason})"
             if path else "none shipped for this device (tune one: moetune tune "
             "... --output T, then serve with MOETUNE_TABLE=T)")
    shipped = shipped_table(sku)
    if path is not None and path != shipped and shipped.is_file() and outdated(shipped, path):
        table += "; the shipped table has changed since it was adopted: run moetune adopt"
    rule = rule_choice(problem, sku)
    lines = [f"device:  {sku.label()}, {sku.memory_bytes / 2**30:.0f} GiB",
             "software: " + ", ".join(f"{k} {v}" for k, v in env.items() if v),
             f"vllm:    {vllm_text()}",
             *([f"fp8:     {fp8}"] if (fp8 := cpu_fp8_text(sku)) else []),
             f"table:   {table}",
             f"rule:    {rule.reason}",
             f"families for {problem.describe()} (every registered kernel):"]
    for name, why in registry.eligibility(problem, sku).items():
        role = _role(registry.get(name), rule.kernel) if why is None else ""
        lines.append(f"  {name:<34} {'eligible' + role if why is None else 'no: ' + why}")
    return "\n".join(lines)


def _role(kernel: type[BaseKernel], rule: str) -> str:
    """What ``moetune tune`` does with an eligible family here."""
    if not kernel.candidate:
        return ", not tuned"
    size = kernel.space_size()
    role = f", searched ({size} configs)" if kernel.params else ", timed (no parameters)"
    return role + (", the rule's pick" if kernel.name == rule else "")


def vllm_text() -> str:
    """Whether the plugin serves with the installed vLLM, and the releases it supports."""
    found = versions.installed()
    if found == "unknown":
        return (f"not installed; the plugin serves vLLM {versions.supported_list()} "
                f"(pip install \"vllm{versions.supported_range().replace(' ', '')}\")")
    why = versions.aside(found)
    if why:
        return f"{why}: the plugin disables itself and vLLM serves its own kernels"
    return f"{found}, supported (the plugin serves vLLM {versions.supported_list()})"


def cpu_fp8_text(sku: SKU) -> str:
    """Why vLLM's CPU build cannot serve fp8 MoE models on this CPU ("" where it can, or off
    the CPU): it fails to load them with "Unsupported FP8 MoE backend: NONE", which says
    nothing of the reason."""
    if sku.vendor is not Vendor.CPU or versions.installed() == "unknown":
        return ""
    _, why = fp8_experts_class(DType.BFLOAT16, "silu", True, False)
    return f"vLLM cannot load fp8 MoE checkpoints on this CPU: {why}" if why else ""


def merge_text(r: db.MergeReport) -> str:
    lines = [f"merged into {r.output}: {r.rows} winners, {len(r.conflicts)} conflicts"]
    lines += [f"  {c}" for c in r.conflicts]
    return "\n".join(lines)
