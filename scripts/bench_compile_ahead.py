"""Tuner wall time with and without compiling candidates ahead in parallel, from a cold cache.

Usage: python scripts/bench_compile_ahead.py --preset mixtral-8x7b --buckets 16,1024
           [--trials 24] [--workers 0,8] [--commit HASH] [--keep DIR] > report.md

Each setting runs the tuning job of ``moetune tune --device cuda --compile-workers N`` with an
empty Triton cache directory (every config compiles; the job's worker processes inherit it), one
after another on the same GPU. It prints each setting's wall time and where it went (the job's
per-bucket phases), then every bucket's winner and speedup over the rule per setting: batching
the asks changes the order Optuna samples in, so the winners may differ.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from moetune import db
from moetune.runtime.platform import detect_sku, environment
from moetune.tuner.bucket import BucketOutcome
from moetune.tuner.job import JobOptions, run_job
from moetune.tuner.presets import preset as get_preset
from moetune.tuner.shapes import parse_buckets

PHASES = ("setup", "compile_ahead", "first_calls", "timing", "confirm")


def tune(preset: str, buckets: str, trials: int, workers: int,
         table: Path) -> tuple[float, list[BucketOutcome]]:
    """Wall seconds and outcomes of one job with ``workers`` compile processes, cold cache."""
    p = get_preset(preset)
    problems = [p.shape.problem(m) for m in parse_buckets(buckets, p.buckets)]
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        start = time.perf_counter()
        outcomes = run_job(problems, table, detect_sku("cuda"),
                           JobOptions(device="cuda", trials=trials, compile_workers=workers))
        took = time.perf_counter() - start
    failed = [o.error for o in outcomes if o.error]
    if failed:
        raise SystemExit(f"tuning with {workers} compile workers failed: {failed}")
    return took, outcomes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="mixtral-8x7b")
    parser.add_argument("--buckets", default="16,1024")
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--workers", default="0,8", help="compile worker counts to compare")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--keep", type=Path, help="keep the tables in this folder")
    args = parser.parse_args()
    settings = [int(w) for w in args.workers.split(",")]
    folder = args.keep or Path(tempfile.mkdtemp(prefix="moetune-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    walls, outcomes, tables = {}, {}, {}
    for workers in settings:
        tables[workers] = folder / f"{args.preset}-workers{workers}.db"
        tables[workers].unlink(missing_ok=True)
        walls[workers], outcomes[workers] = tune(args.preset, args.buckets, args.trials, workers,
                                                 tables[workers])

    print(f"# Tuning wall time, cold Triton cache: {args.preset}, buckets {args.buckets}, "
          f"{args.trials} trials\n")
    print(f"GPU: {detect_sku('cuda').label()}; date: {datetime.date.today()}; commit: "
          f"{args.commit}; CPU cores: {os.cpu_count()}; env: {json.dumps(environment())}\n"
          f"command: python {' '.join(sys.argv)}\n")
    print("Seconds summed over buckets; the job's start (worker processes, imports) is the rest "
          "of the wall time.\n")
    print("| compile workers | wall s | vs serial | measured | " +
          " | ".join(f"{p.replace('_', ' ')} s" for p in PHASES) + " |")
    print("|---|---|---|---|" + "---|" * len(PHASES))
    serial = walls[settings[0]]
    for workers in settings:
        phases = [sum(o.seconds.get(p, 0.0) for o in outcomes[workers]) for p in PHASES]
        print(f"| {workers} | {walls[workers]:.0f} | {serial / walls[workers]:.2f}x | "
              f"{sum(o.measured for o in outcomes[workers])} | "
              + " | ".join(f"{s:.1f}" for s in phases) + " |")
    print("\n| tokens | " + " | ".join(f"winner ({w} workers)" for w in settings) + " |")
    print("|---|" + "---|" * len(settings))
    rows = {w: {r.bucket["num_tokens"]: r for r in db.read_winners(tables[w]).rows}
            for w in settings}
    for m in sorted(set().union(*(r.keys() for r in rows.values()))):
        cells = []
        for w in settings:
            r = rows[w].get(m)
            cells.append(f"{r.kernel} {r.median_us:.1f}us ({r.speedup:.2f}x)" if r else "-")
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
