"""The ``moetune`` command line: the tuner's commands (``tuner/cli.py``) plus the serving ones,
``show``, ``lookup``, ``doctor`` and ``adopt``, which answer for (and prepare) what the plugin
serves."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from moetune.db import open_table, read_winners
from moetune.runtime.dispatcher import Dispatcher, default_table, table_sku
from moetune.runtime.kernels.base import WeightLayout
from moetune.runtime.plan import ShapePlan
from moetune.runtime.platform import detect_sku
from moetune.runtime.registry import default_registry
from moetune.runtime.vllm import versions
from moetune.serving.settings import Mode, Settings
from moetune.tuner import adopt as adopt_table
from moetune.tuner import cli as tuner_cli
from moetune.tuner import report
from moetune.tuner.cli import (EP, TP, Act, Config, Device, DeviceOpt, DTypeOpt, Experts,
                               Hidden, Inter, OnInput, Preset, Quant, TopK, app, device_of,
                               errors_to_exit, out, run_job_with_progress)
from moetune.tuner.job import JobOptions
from moetune.tuner.shapes import ShapeOptions, resolve

__all__ = ["app"]

@app.command()
@errors_to_exit
def adopt(device: DeviceOpt = Device.auto,
          reps: Annotated[int, typer.Option(min=2, help="Timed repetitions per "
                                            "measurement")] = 20) -> None:
    """Re-confirm the table shipped for this GPU under the torch/Triton/CUDA versions installed
    here, into this machine's copy ($MOETUNE_HOME/tables), which serving, lookup and doctor then
    use by default: each bucket's winner re-timed beside vLLM's pick, kept where it still wins.
    Resumable; starts again from the shipped table after an upgrade changed it."""
    sku = detect_sku(device.value)
    path, problems = adopt_table.prepare(sku)
    run_job_with_progress(problems, str(path), sku, JobOptions(
        device=device_of(sku), reps=reps, skip_tuned=True, reconfirm=True))
    out.print(f"serving uses {path} on this device by default now (MOETUNE_TABLE overrides)",
              highlight=False)


def _aside(settings: Settings) -> str | None:
    """Why the plugin hooks no layer here (``serving/plugin.py register``), or None: the one
    answer of ``show`` and ``lookup``. Without vLLM they answer for the table alone."""
    if settings.mode is Mode.OFF:
        return "MOETUNE_MODE=off"
    found = versions.installed()
    return versions.aside(found) if found != "unknown" else None


def _serving_settings() -> tuple[str | None, bool]:
    """``_aside`` and ``MOETUNE_DETERMINISTIC`` as serving reads them: what ``show`` and the
    closing table of ``tune`` and ``adopt`` mark served."""
    settings = Settings.from_env()
    return _aside(settings), settings.deterministic


tuner_cli.serving_settings = _serving_settings


@app.command()
@errors_to_exit
def show(table: Annotated[str, typer.Argument(help="Table file or database URL")],
         as_json: Annotated[bool, typer.Option("--json", help="One JSON object per "
                                               "winner row")] = False,
         device: DeviceOpt = Device.auto) -> None:
    """Print a table's winners: bucket, kernel, params, time, speedup, error, and whether
    serving on this device would use each row under the MOETUNE_* and VLLM_BATCH_INVARIANT
    settings here (and why not: stale baseline, other SKU, MOETUNE_DETERMINISTIC=1, ...)."""
    snapshot = read_winners(table)
    sku = detect_sku(device.value)
    if as_json:
        for row in report.winner_dicts(snapshot, sku, *_serving_settings()):
            typer.echo(json.dumps(row, sort_keys=True))
        return
    out.print(report.winners_table(snapshot, sku, *_serving_settings()))


@app.command()
@errors_to_exit
def lookup(
    num_tokens: Annotated[int, typer.Option(min=1, help="Tokens in the MoE call")],
    table: Annotated[Optional[str], typer.Option(
        help="Table file or database URL to consult (default: MOETUNE_TABLE as serving reads "
        "it, else this machine's adopted table for this device, else the one shipped for it, "
        "if any)")] = None,
    preset: Preset = None, config: Config = None, tp: TP = 1, ep: EP = 1,
    hidden: Hidden = None, intermediate: Inter = None, experts: Experts = None,
    topk: TopK = None, dtype: DTypeOpt = None, quant: Quant = None, activation: Act = None,
    router_weight_on_input: OnInput = None,
    device: Annotated[Device, typer.Option(
        help="The device to answer for (auto: the GPU if any, else the CPU)")] = Device.auto,
    sku: Annotated[Optional[str], typer.Option(
        help="Answer for another device, e.g. nvidia:H200, from its table (--table, else the "
        "one shipped for it) and vLLM's configs installed here; its versions are not checked",
        show_default=False)] = None,
) -> None:
    """What serving runs for one MoE call, and why: the plan vLLM's plugin builds under the
    MOETUNE_* and VLLM_BATCH_INVARIANT settings here."""
    settings = Settings.from_env()
    shape, _ = resolve(ShapeOptions(preset, config, tp, ep, hidden, intermediate, experts, topk,
                                    dtype, quant, activation, router_weight_on_input))
    problem = shape.problem(num_tokens)
    if sku is not None:
        target, path = table_sku(sku, table)
        dispatcher = Dispatcher.load(path, target, check_environment=False)
    else:
        target = detect_sku(device.value)
        if table is not None:  # one named but unreadable is an error; serving would fall back
            open_table(table).close()
        dispatcher = Dispatcher.load(table or settings.table or default_table(target), target)
    plan = ShapePlan.build(dispatcher, problem.shape, WeightLayout.PLAIN,
                           settings.deterministic)
    out.print(report.lookup_text(problem, dispatcher, plan, _aside(settings)), highlight=False)


@app.command()
@errors_to_exit
def doctor(device: DeviceOpt = Device.auto, preset: Annotated[str, typer.Option(
        help="Shape whose kernel eligibility to show")] = "tiny") -> None:
    """Platform, SKU, software versions, and which kernels are eligible here (and why not)."""
    shape, _ = resolve(ShapeOptions(preset=preset))
    sku = detect_sku(device.value)
    out.print(report.doctor_text(sku, default_registry, shape.problem(1)), highlight=False,
              soft_wrap=True)
