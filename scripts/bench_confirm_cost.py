"""What confirmation costs in a real tuning job: per bucket, the seconds spent searching and
confirming, the rounds the decision took, the disturbed rounds timed again, and the re-timings
beside what the previous rule (5 rounds of every finalist, no more) would have made.

It runs ``moetune tune``'s own job (``run_job``) on the buckets asked for, into a scratch table,
and prints Markdown. On an H200, Qwen3-30B-A3B at four buckets takes a few minutes:

    python scripts/bench_confirm_cost.py --preset qwen3-30b-a3b --buckets 1,64,1024,4096 \\
        --device cuda > bench/results/confirm-cost-h200-DATE.md

On the CPU: ``--preset tiny --buckets 1,16 --device cpu``. The rule is today's, as ``moetune
doctor`` prints it (set ``VLLM_TUNED_CONFIG_FOLDER`` as for the table being reproduced).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
from pathlib import Path

import torch

from moetune.runtime.platform import detect_sku
from moetune.tuner.bucket import BucketOutcome
from moetune.tuner.confirm import ALPHA, DISTURBED, MARGIN
from moetune.tuner.job import JobOptions, run_job, source_commit
from moetune.tuner.shapes import ShapeOptions, parse_buckets, resolve
from moetune.tuner.timing import interval_text

#: Rounds of every finalist the previous rule timed, and nothing more.
PREVIOUS_ROUNDS = 5


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Runtime is bounded by --trials and the buckets: each bucket runs one search of "
               "--trials candidates and one confirmation (at most 20 deciding rounds).")
    parser.add_argument("--preset", default="tiny", help="a moetune preset (default: tiny)")
    parser.add_argument("--buckets", default=None,
                        help="comma-separated num_tokens (default: 1,64,1024,4096; tiny: 1,16)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--trials", type=int, default=16, help="Optuna trials per bucket")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement")
    parser.add_argument("--output", type=Path, default=None,
                        help="table to write (default: a scratch file, removed afterwards)")
    args = parser.parse_args()
    shape, _ = resolve(ShapeOptions(preset=args.preset))
    default = "1,16" if args.preset == "tiny" else "1,64,1024,4096"
    problems = [shape.problem(m) for m in parse_buckets(args.buckets or default, ())]
    sku = detect_sku(args.device)
    device = "cpu" if sku.vendor.value == "cpu" else "cuda"
    opts = JobOptions(device=device, trials=args.trials, reps=args.reps)
    with tempfile.TemporaryDirectory() as scratch:
        output = args.output or Path(scratch) / "confirm-cost.db"
        outcomes = run_job(problems, output, sku, opts, on_bucket=_progress)
    print(report(outcomes, args, sku.label()))
    if any(o.error for o in outcomes):
        sys.exit(1)


def _progress(o: BucketOutcome) -> None:
    d = o.decision
    done = d and (f"{d.winner.kernel}, {d.rounds} rounds, {o.seconds['confirm']:.1f}s of "
                  f"{o.seconds['total']:.1f}s confirming")
    print(f"M={o.problem.num_tokens}: {done or o.error or o.skipped}", file=sys.stderr,
          flush=True)


def report(outcomes: list[BucketOutcome], args: argparse.Namespace, device: str) -> str:
    lines = [f"# Confirmation cost: {args.preset} on {device}", "",
             f"- date {datetime.date.today()}, commit {source_commit()}, host {platform.node()}, "
             f"torch {torch.__version__}",
             f"- command: `python scripts/bench_confirm_cost.py {' '.join(sys.argv[1:])}`",
             f"- decision: a win needs the ratio interval (each bound wrong with probability "
             f"{ALPHA:g}, at least as wide as the re-timings' repetitions imply) above "
             f"{1 + MARGIN:.2f}x; re-timings over {DISTURBED}x their kernel's fastest round (for "
             f"a rule variant, also its search timing) are left out and their rounds timed "
             f"again; 5 clean rounds per "
             f"look, at most 20 deciding rounds (after 5 choosing the contender when there are "
             f"several). Previous rule: {PREVIOUS_ROUNDS} rounds of every finalist.", "",
             "| M | winner | speedup over the rule's pick (interval) | search s | confirm s | "
             "confirm share | deciding rounds | disturbed | re-timings | previous rule's | "
             "est. previous confirm s |", "|---" * 11 + "|"]
    totals = {"search": 0.0, "confirm": 0.0, "now": 0, "previous": 0, "previous_s": 0.0}
    for o in outcomes:
        if o.decision is None:
            lines.append(f"| {o.problem.num_tokens} | {o.error or o.skipped} |" + " |" * 9)
            continue
        d, s = o.decision, o.seconds
        search, confirm = s["total"] - s["confirm"], s["confirm"]
        previous = PREVIOUS_ROUNDS * d.finalists
        previous_s = confirm * previous / d.retimes
        b = d.baseline
        gain = d.reason if d.winner.kernel == b.kernel and d.winner.params == b.params \
            else f"{d.speedup:.3f}x ({interval_text(b.ratio_lo, b.ratio_hi, b.rounds)})"
        lines.append(f"| {o.problem.num_tokens} | {d.winner.kernel} | {gain} | {search:.1f} | "
                     f"{confirm:.1f} | {confirm / s['total']:.0%} | {d.rounds} | {b.disturbed} "
                     f"| {d.retimes} | {previous} | {previous_s:.1f} |")
        for key, value in (("search", search), ("confirm", confirm), ("now", d.retimes),
                           ("previous", previous), ("previous_s", previous_s)):
            totals[key] += value
    spent = totals["search"] + totals["confirm"]
    if spent:
        lines += ["", f"In all: {totals['search']:.1f}s searching, {totals['confirm']:.1f}s "
                      f"confirming ({totals['confirm'] / spent:.0%} of the time); "
                      f"{totals['now']} re-timings where the previous rule made "
                      f"{totals['previous']} (about {totals['previous_s']:.1f}s)."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
