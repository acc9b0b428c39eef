"""How far the tuned winners, every kernel family's best and vLLM's pick are from the roofline,
per preset and num_tokens bucket, read from a tuning table (no GPU needed).

Usage: python scripts/bench_roofline.py TABLE [--configs DIR] [--ceilings hbm_tbps=..,...
           [--ceilings-for-every-run]]
           [--presets mixtral-8x7b,qwen3-30b-a3b,...] > roofline.md

``TABLE`` is what ``moetune tune --device cuda`` wrote: its winner rows, with the rule each was
timed against side by side (the confirmation rounds), and every stored trial of the search. Per
bucket it prints the HBM floor (the routed experts' weights plus activations in and out at the
HBM bandwidth the run measured when it started), the compute floor (the GEMM FLOPs at the
measured matmul rate of the layer's GEMM dtype), the rule's time, each family's best trial,
the winner and the fractions of the roofline (the larger floor) reached. Family bests are
search timings (a few repetitions, inputs rotated); the winner and the rule are the
confirmation's medians. ``--configs``: vLLM's tuned-config folder, so the rule is vLLM's pick
for the shape and GPU; ``--ceilings``: for runs that recorded none, or with
``--ceilings-for-every-run`` for all (one floor across runs of different days).
"""

from __future__ import annotations

import argparse
import os
from statistics import geometric_mean

#: The issue's targets: per preset geomean fraction and speedup, and per-bucket floors.
ROOFLINE_GOAL, ROOFLINE_FLOOR = 0.85, 0.60
SPEEDUP_GOAL, SPEEDUP_FLOOR = 1.30, 0.99
DEFAULT_PRESETS = "mixtral-8x7b,qwen3-30b-a3b,deepseek-v3,llama-4-maverick"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("table")
    parser.add_argument("--configs", help="vLLM's tuned-config folder (the CUDA rule)")
    parser.add_argument("--ceilings", help="for runs that recorded none, e.g. "
                        "hbm_tbps=4.28,bf16_tflops=774,fp8_tflops=1410")
    parser.add_argument("--ceilings-for-every-run", action="store_true",
                        help="--ceilings also for runs that measured their own: one floor for "
                        "rows tuned on different days")
    parser.add_argument("--presets", default=DEFAULT_PRESETS)
    args = parser.parse_args()
    if args.configs:
        os.environ["VLLM_TUNED_CONFIG_FOLDER"] = os.path.realpath(args.configs)
    from moetune.tuner.report_data import load_report
    from moetune.tuner.roofline import parse_ceilings

    report = load_report(args.table, parse_ceilings(args.ceilings) if args.ceilings else None,
                         every_run=args.ceilings_for_every_run)
    wanted = args.presets.split(",")
    shapes = sorted((s for s in report.shapes if s.preset in wanted),
                    key=lambda s: wanted.index(s.preset))
    print(f"# Roofline of `{args.table}`\n")
    env = {k: v for k, v in report.environment.items() if v}
    print(f"Measured under {', '.join(f'{k} {v}' for k, v in sorted(env.items()))}."
          " Times in microseconds.\n")
    summary = []
    for shape in shapes:
        summary.append(_shape_table(shape))
    print("## Per preset\n")
    print("| preset | buckets | roofline geomean | lowest bucket | speedup over vLLM geomean | "
          "lowest bucket |")
    print("|---|---|---|---|---|---|")
    for name, n, fractions, speedups in summary:
        print(f"| {name} | {n} | {_geo(fractions)} | {_low(fractions)} | {_geo(speedups, 'x')} | "
              f"{_low(speedups, 'x')} |")
    speedup_means = [geometric_mean(s) for *_, s in summary if s]
    if speedup_means:
        overall = geometric_mean(speedup_means)
        print(f"\nGeomean over the presets' geomean speedups: {overall:.3f}x. "
              f"Goals: roofline >= {ROOFLINE_GOAL} per preset with no bucket below "
              f"{ROOFLINE_FLOOR}; speedup >= {SPEEDUP_GOAL}x over the presets with no bucket "
              f"below {SPEEDUP_FLOOR}x.")


def _shape_table(shape) -> tuple[str, int, list[float], list[float]]:
    families = sorted({f for b in shape.buckets for f in b.family_bests()})
    print(f"## {shape.title}\n")
    columns = ["tokens", "HBM floor", "compute floor", "rule", *families, "winner", "winner us",
               "winner / roofline", "rule / roofline", "winner vs rule"]
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    fractions, speedups = [], []
    for b in shape.buckets:
        bests = b.family_bests()
        cells = [f"{bests[f]:.1f}" if bests.get(f) else ("x" if f in bests else "-")
                 for f in families]
        hbm = f"{b.floors.hbm_us:.1f}" if b.floors else "-"
        compute = f"{b.floors.compute_us:.1f}" if b.floors and b.floors.compute_us else "-"
        rule = f"{b.row.baseline_us:.1f}" if b.row.baseline_us else "-"
        if b.roofline:
            fractions.append(b.roofline)
        if b.row.speedup:
            speedups.append(b.row.speedup)
        cells = [str(b.num_tokens), hbm, compute, rule, *cells, b.row.kernel,
                 f"{b.row.median_us:.1f}", _pct(b.roofline), _pct(b.rule_roofline),
                 _x(b.row.speedup)]
        print("| " + " | ".join(cells) + " |")
    note = "" if families else " This table stores no trials for this shape."
    print(f"\n(x: tried, no trial passed; -: not tried. Family bests are search timings.{note})\n")
    return shape.name, len(shape.buckets), fractions, speedups


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _geo(values: list[float], unit: str = "") -> str:
    return f"{geometric_mean(values):.{3 if unit else 2}f}{unit}" if values else "-"


def _low(values: list[float], unit: str = "") -> str:
    return f"{min(values):.{3 if unit else 2}f}{unit}" if values else "-"


if __name__ == "__main__":
    main()
