"""The tuner's commands of the ``moetune`` command line (``moetune.cli`` adds the serving
ones): thin commands over the library; errors become one line + exit 1."""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Callable, NoReturn, Optional, TypeVar

import typer
from typer.core import TyperGroup
import optuna
from rich.console import Console
from rich.progress import Progress
from rich.text import Text

from moetune import db
from moetune.errors import MoetuneError, ShapeError, TableError, TuningError
from moetune.runtime.platform import SKU, detect_sku
from moetune.runtime.problem import Activation, DType, MoEProblem, QuantScheme
from moetune.runtime.rules import rule_choice
from moetune.tuner import formats_aiter, formats_io, formats_vllm, report
from moetune.tuner.inputs import Routing
from moetune.tuner.bucket import BucketOutcome
from moetune.tuner.job import JobOptions, run_job
from moetune.tuner.search import REFINE, TRIALS
from moetune.tuner.shapes import (ShapeOptions, parse_buckets, problems_from_misses,
                                  problems_in_table, resolve)

# vLLM warns when its CPU kernels are first imported ("Triton is installed, but doesn't include
# CPU backend"), before its own logging is set up; moetune's output is its own.
if "VLLM_LOGGING_LEVEL" not in os.environ:
    logging.getLogger("vllm").setLevel(logging.ERROR)

# Piped output (files, CI logs) gets wide lines instead of wrapped table cells.
out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True)


class _OneLineErrors(TyperGroup):
    """Usage errors (a value out of range, an unknown choice or option) are user errors like
    moetune's own: one ``error:`` line on stderr and exit 1, not click's box and exit 2.

    They are raised while parsing the app's arguments (``make_context``) or a command's, which
    the app does inside ``invoke``; a bare ``moetune`` still prints the help.
    """

    def make_context(self, *args: Any, **kwargs: Any) -> typer.Context:
        with _usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: typer.Context) -> Any:
        with _usage_errors():
            return super().invoke(ctx)


#: click's ``UsageError``, from the click typer runs on (typer 0.29 vendors its own).
_UsageError: type[Any] = typer.BadParameter.__mro__[1]


@contextlib.contextmanager
def _usage_errors() -> Iterator[None]:
    try:
        yield
    except _UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare command: its help, as typer does
            raise
        _fail(e.format_message())


def _fail(message: str) -> NoReturn:
    """The one way a command fails: ``error: message`` on stderr, exit code 1."""
    err.print(Text.assemble(("error:", "red"), f" {message}"), highlight=False, soft_wrap=True)
    raise typer.Exit(code=1) from None


app = typer.Typer(help="Measured, per-GPU dispatch tables for Mixture-of-Experts kernels.",
                  no_args_is_help=True, pretty_exceptions_enable=False, cls=_OneLineErrors,
                  # click's plain help wraps long option names; rich's panels cut them
                  rich_markup_mode=None)
F = TypeVar("F", bound=Callable[..., Any])
optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per bucket is ours to print


def errors_to_exit(fn: F) -> F:
    """moetune's own errors are user errors: one red line on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MoetuneError as e:
            _fail(str(e))

    return wrapper  # type: ignore[return-value]


class Device(str, enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class ExportFormat(str, enum.Enum):
    sqlite = "sqlite"
    vllm = "vllm"
    aiter = "aiter"


Preset = Annotated[Optional[str], typer.Option(help="Named shape: tiny, mixtral-8x7b, ...")]
Config = Annotated[Optional[Path], typer.Option(help="Local Hugging Face config.json")]
TP = Annotated[int, typer.Option("--tp", help="Tensor-parallel size (shards intermediate)")]
EP = Annotated[int, typer.Option("--ep", help="Expert-parallel size (shards experts)")]
Hidden = Annotated[Optional[int], typer.Option(help="Hidden size")]
Inter = Annotated[Optional[int], typer.Option(help="Intermediate size per partition")]
Experts = Annotated[Optional[int], typer.Option(help="Local experts")]
TopK = Annotated[Optional[int], typer.Option(help="Experts per token")]
DTypeOpt = Annotated[Optional[DType], typer.Option(
    "--dtype", case_sensitive=False, help="Activation dtype (default: the preset's or bfloat16)")]
Quant = Annotated[Optional[QuantScheme], typer.Option(
    case_sensitive=False, help="Weight quantization (default: the preset's or none)")]
Act = Annotated[Optional[Activation], typer.Option(
    case_sensitive=False, help="Activation function (default: the preset's or silu)")]
OnInput = Annotated[Optional[bool], typer.Option(
    "--router-weight-on-input/--router-weight-on-output", help="Where the router weight applies")]
DeviceOpt = Annotated[Device, typer.Option(help="Where to measure")]


@app.command()
@errors_to_exit
def tune(
    output: Annotated[str, typer.Option("--output", "-o", help="Table file to write, or a "
                                        "database URL (postgresql+psycopg://...) shared by jobs")],
    preset: Preset = None, config: Config = None, tp: TP = 1, ep: EP = 1,
    hidden: Hidden = None, intermediate: Inter = None, experts: Experts = None,
    topk: TopK = None, dtype: DTypeOpt = None, quant: Quant = None, activation: Act = None,
    router_weight_on_input: OnInput = None, device: DeviceOpt = Device.auto,
    buckets: Annotated[Optional[str], typer.Option(help="num_tokens list, e.g. 1,8,64")] = None,
    trials: Annotated[int, typer.Option(min=1, help="Optuna trials per bucket")] = TRIALS,
    refine: Annotated[int, typer.Option(
        min=0, help="Evaluations of the local search from the best after the trials (one-step "
        "moves of one parameter while they gain; 0: none)")] = REFINE,
    routing: Annotated[Routing, typer.Option(help="Expert load distribution")] = Routing.UNIFORM,
    seed: Annotated[int, typer.Option(min=0, max=2**32 - 1,
                                      help="Seed for inputs and the sampler")] = 0,
    reps: Annotated[int, typer.Option(min=2, help="Timed repetitions per measurement")] = 20,
    isolate: Annotated[Optional[bool], typer.Option(
        "--isolate/--no-isolate", help="Measure in a restartable worker process "
        "(default: on for CUDA)")] = None,
    skip_tuned: Annotated[bool, typer.Option(
        "--skip-tuned", help="Leave buckets the table already has a measured winner for (timed "
        "against the rule as it is now, under these torch/Triton/CUDA versions)")] = False,
    reconfirm: Annotated[bool, typer.Option(
        "--reconfirm", help="Where the table has a winner for a bucket, timed under any "
        "versions or rule, re-time it against the rule here and confirm again instead of "
        "searching (seconds per bucket); buckets without one are searched. Without a shape: "
        "every bucket the table has for this GPU (those of --buckets, if given)")] = False,
    deterministic: Annotated[bool, typer.Option(
        "--deterministic", help="Only kernels whose output bits are the same in every call (no "
        "atomics adding more than two values into one element): a table for serving under "
        "MOETUNE_DETERMINISTIC=1")] = False,
    gpus: Annotated[int, typer.Option(
        min=1, help="Tune buckets in parallel on this many GPUs of this host (cuda:0 ... "
        "cuda:N-1, the same model), one bucket per GPU at a time")] = 1,
    compile_workers: Annotated[Optional[int], typer.Option(
        min=0, help="Processes compiling Triton candidates ahead of timing, in parallel "
        "(0: compile while timing; default: half the CPU cores, at most 8, on CUDA)")] = None,
    from_misses: Annotated[Optional[Path], typer.Option(
        help="Tune exactly the buckets a serving process recorded (MOETUNE_MODE=record)")] = None,
    optuna_storage: Annotated[Optional[str], typer.Option(
        help="Optuna storage URL for the studies (default: in memory)")] = None,
) -> None:
    """Time every eligible kernel per bucket and write the winners to a table."""
    sku = detect_sku(device.value)
    sizes = (preset, config, hidden, intermediate, experts, topk)
    if from_misses:
        problems = problems_from_misses(from_misses)
    elif reconfirm and all(v is None for v in sizes):
        problems = problems_in_table(_existing_rows(output), sku)
        if buckets:
            wanted = set(parse_buckets(buckets, ()))
            problems = [p for p in problems if p.num_tokens in wanted]
    else:
        shape, default_buckets = resolve(ShapeOptions(
            preset, config, tp, ep, hidden, intermediate, experts, topk, dtype, quant,
            activation, router_weight_on_input))
        problems = [shape.problem(m) for m in parse_buckets(buckets, default_buckets)]
    dev = device_of(sku)
    opts = JobOptions(device=dev, trials=trials, refine=refine, seed=seed, routing=routing, reps=reps,
                      optuna_storage=optuna_storage, isolate=isolate,
                      compile_workers=compile_workers, devices=_gpus(gpus, dev, sku),
                      skip_tuned=skip_tuned, reconfirm=reconfirm, deterministic=deterministic)
    run_job_with_progress(problems, output, sku, opts)


#: What serving here leaves aside and whether it takes deterministic winners only, for the
#: closing table's "served here": the tuner knows no serving settings, so the command line above
#: it (``moetune.cli``) puts its reader here; alone, the tuner answers as if none were in force.
serving_settings: Callable[[], tuple[str | None, bool]] = lambda: (None, False)


def run_job_with_progress(problems: list[MoEProblem], output: str, sku: SKU,
                          opts: JobOptions) -> None:
    """Run the job with a progress bar and a line per bucket, then print the table.

    Raises:
        TuningError: some buckets failed (each said why in its line).
    """
    shown = db.display_url(output) if db.is_url(output) else output
    out.print(f"tuning {len(problems)} buckets on {sku.label()} -> {shown}")
    if problems:  # rows are timed against this: serving here uses them while it stays the rule
        out.print(f"timed against {rule_choice(problems[0], sku).reason}", highlight=False)
    steps = opts.trials + opts.refine  # the local search may stop early
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("", total=steps)

        def on_bucket(o: BucketOutcome) -> None:
            if not opts.devices:  # one bucket at a time: a bar per bucket
                progress.reset(task, total=steps)
            out.print(report.outcome_line(o), highlight=False)

        if opts.devices:
            progress.reset(task, total=steps * len(problems))

        def on_trial() -> None:
            progress.advance(task)

        progress.update(task, description=problems[0].describe() if problems else "")
        outcomes = run_job(problems, output, sku, opts, on_bucket=on_bucket, on_trial=on_trial)
    out.print(report.winners_table(db.read_winners(output), sku, *serving_settings()))
    failed = [o for o in outcomes if o.error]
    if failed:
        raise TuningError(f"{len(failed)} of {len(outcomes)} buckets failed (see above)")


def device_of(sku: SKU) -> str:
    """The device a job on ``sku`` measures on."""
    return "cpu" if sku.vendor.value == "cpu" else "cuda"


def _existing_rows(output: str) -> list[db.WinnerRecord]:
    """The winners of the table ``tune --reconfirm`` re-confirms in place.

    Raises:
        ShapeError: no such table file (the shape must then be given).
    """
    if not db.is_url(output) and not db.file_path(output).exists():
        raise ShapeError(f"{output}: no such table to re-confirm; give a shape (--preset, "
                         "--config or the sizes) to tune one")
    return db.read_winners(output).rows


def _gpus(count: int, device: str, sku: SKU) -> tuple[str, ...]:
    """``cuda:0`` ... for ``--gpus``; () for one.

    Raises:
        TuningError: not CUDA, fewer GPUs than asked, or GPUs of other models (one table is
            for one SKU).
    """
    if count == 1:
        return ()
    if device != "cuda":
        raise TuningError("--gpus needs --device cuda")
    import torch

    if torch.cuda.device_count() < count:
        raise TuningError(f"--gpus {count}: this host has {torch.cuda.device_count()} GPUs")
    devices = tuple(f"cuda:{i}" for i in range(count))
    others = [d for d in devices if not detect_sku(d).matches(sku)]
    if others:
        raise TuningError(f"--gpus {count}: {', '.join(others)} are not {sku.label()}; a table "
                          "is for one GPU model")
    return devices


@app.command("export")
@errors_to_exit
def export_(table: Annotated[str, typer.Argument(help="Table file or database URL")], output: Annotated[str, typer.Option("--output", "-o", help=(
                "sqlite/aiter: the file to write; vllm: the folder for the JSON files"))],
            format: Annotated[ExportFormat, typer.Option("--format")] = ExportFormat.sqlite,
            with_measurements: Annotated[bool, typer.Option(
                help="Include every trial's measurement")] = False,
            device_name: Annotated[Optional[str], typer.Option(
                help="vllm: vLLM's device name, e.g. NVIDIA_H200 (default: from the SKU)")] = None,
            aiter_base: Annotated[Optional[Path], typer.Option(
                help="aiter: the tuned_fmoe.csv active while tuning (default: aiter's own)")] = None,
            ) -> None:
    """Write a table as a self-contained artifact, vLLM config files or aiter's CSV. Invalid
    rows (unknown kernel, params outside its space or not JSON) are skipped with the reason."""
    if format is ExportFormat.vllm:
        out.print(formats_vllm.export_vllm(table, Path(output), device_name).text(),
                  highlight=False)
    elif format is ExportFormat.aiter:
        out.print(formats_aiter.export_aiter(table, Path(output), aiter_base).text(), highlight=False)
    else:
        copied = formats_io.merge_valid(table, None, output,
                                        include_measurements=with_measurements)
        typer.echo("\n".join([f"exported {copied.rows} rows of {table} -> {output}",
                              *formats_io.merge_notes(copied)]))


@app.command("import")
@errors_to_exit
def import_(file: Path, output: Annotated[str, typer.Option(
                "--output", "-o", help="Table file, or its sqlite:/// URL")],
            preset: Preset = None, hidden: Hidden = None, topk: TopK = None,
            dtype: DTypeOpt = None, quant: Quant = None, activation: Act = None,
            router_weight_on_input: OnInput = None,
            arch: Annotated[Optional[str], typer.Option(
                help="vllm: the device's arch when its name is unknown (sm_90, gfx942)")] = None,
            ) -> None:
    """Bring a moetune table, vLLM tuned-config JSON (file or folder) or aiter tuned_fmoe.csv
    into --output (merged if it exists); the format is detected. vLLM file names lack the
    hidden size and topk: give --hidden and --topk, or --preset (--quant picks per-tensor or
    per-channel for fp8_w8a8 files without a block shape). Rows that would be invalid in a
    table are skipped with the reason; if none is valid, the --output file is left untouched."""
    if db.is_url(output):
        raise TableError(f"{db.display_url(output)}: import writes a table file (or its "
                         "sqlite:/// URL); import into a file, then merge it into the server")
    target = db.file_path(output)  # a sqlite:/// URL is its file: the same locks and claims
    fmt = formats_io.detect(file)
    if fmt is formats_io.Format.VLLM:
        hints = formats_vllm.shape_hints(preset, hidden, topk, dtype, quant, activation,
                                         router_weight_on_input, arch)
        out.print(formats_vllm.import_vllm(file, target, hints).text(), highlight=False)
    elif fmt is formats_io.Format.AITER:
        out.print(formats_aiter.import_aiter(file, target).text(), highlight=False)
    else:
        if target.exists():
            merged = formats_io.merge_valid(target, file, target, update=True)
            lines = [report.merge_text(merged)]
        else:
            merged = formats_io.merge_valid(file, None, target)
            lines = []
        typer.echo("\n".join([*lines, *formats_io.merge_notes(merged),
                              f"imported {file} -> {target}"]))


@app.command()
@errors_to_exit
def merge(a: Annotated[str, typer.Argument(help="Table file or database URL")],
          b: Annotated[str, typer.Argument(help="Table file or database URL")],
          output: Annotated[str, typer.Option("--output", "-o", help="Table file to write")],
          strict: Annotated[bool, typer.Option(
              "--strict", help="Refuse to merge (nothing written, exit 1) if a row is "
              "invalid, instead of dropping it")] = False) -> None:
    """Merge two tables; per bucket the faster (or, within noise, newer) winner stays. Invalid
    rows (unknown kernel, params outside its space or not JSON) are dropped, one line each."""
    merged = formats_io.merge_valid(a, b, output, strict=strict)
    typer.echo("\n".join([report.merge_text(merged), *formats_io.merge_notes(merged)]))


@app.command("report")
@errors_to_exit
def report_(
    table: Annotated[str, typer.Argument(help="Table file or database URL")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for index.html and "
                                         "its PNG figures (created if missing)")],
    ceilings: Annotated[Optional[str], typer.Option(
        help="Ceilings for the runs that recorded none, to draw floors: "
        "hbm_tbps=4.28,bf16_tflops=774[,fp8_tflops=1410]")] = None,
    ceilings_from: Annotated[Optional[str], typer.Option(
        help="Where --ceilings come from (a benchmark, a data sheet), said on the page")] = None,
    ceilings_for_every_run: Annotated[bool, typer.Option(
        "--ceilings-for-every-run", help="--ceilings also for the runs that measured their "
        "own: one floor for rows tuned on different days")] = False,
) -> None:
    """Write an HTML page with figures of a table: speedup over the rule per bucket, time
    against the HBM and compute floors, which kernel family wins where, how the search
    converged, and where the tuning time went."""
    from moetune.tuner import report_page, roofline  # matplotlib loads for this command only

    given = roofline.parse_ceilings(ceilings) if ceilings else None
    page = report_page.write_report(table, output, given, ceilings_from,
                                    every_run=ceilings_for_every_run)
    out.print(f"report of {table} -> {page}", highlight=False)
