"""Tuner wall time with and without compiling candidates ahead in parallel, from a cold cache.

Usage: python scripts/bench_compile_ahead.py --preset mixtral-8x7b --buckets 1,64,512
           [--trials 24] [--workers 0,8] [--commit HASH] [--keep DIR] > report.md

Each setting runs ``moetune tune --device cuda --compile-workers N`` in its own process with an
empty Triton cache directory (so every config compiles), one after another on the same GPU.
It prints the wall time of each, then every bucket's winner and speedup over the rule per
setting: batching the asks changes the order Optuna samples in, so the winners may differ.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moetune import db
from moetune.runtime.platform import detect_sku, environment


def tune(preset: str, buckets: str, trials: int, workers: int, table: Path) -> float:
    """Seconds ``moetune tune`` took with ``workers`` compile processes and a cold cache."""
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        cmd = [sys.executable, "-c", "from moetune.tuner.cli import app; app()", "tune", str(table), "--preset", preset,
               "--device", "cuda", "--buckets", buckets, "--trials", str(trials),
               "--compile-workers", str(workers)]
        start = time.perf_counter()
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        took = time.perf_counter() - start
    sys.stderr.write(run.stdout[-3000:] + run.stderr[-3000:])
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {run.returncode}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="mixtral-8x7b")
    parser.add_argument("--buckets", default="1,64,512")
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--workers", default="0,8", help="compile worker counts to compare")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--keep", type=Path, help="keep the tables in this folder")
    args = parser.parse_args()
    settings = [int(w) for w in args.workers.split(",")]
    folder = args.keep or Path(tempfile.mkdtemp(prefix="moetune-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    walls, tables = {}, {}
    for workers in settings:
        tables[workers] = folder / f"{args.preset}-workers{workers}.db"
        tables[workers].unlink(missing_ok=True)
        walls[workers] = tune(args.preset, args.buckets, args.trials, workers, tables[workers])

    print(f"# Tuning wall time, cold Triton cache: {args.preset}, buckets {args.buckets}, "
          f"{args.trials} trials\n")
    print(f"GPU: {detect_sku('cuda').label()}; date: {datetime.date.today()}; commit: "
          f"{args.commit}; CPU cores: {os.cpu_count()}; env: {json.dumps(environment())}\n"
          f"command: python {' '.join(sys.argv)}\n")
    print("| compile workers | wall s | vs serial |\n|---|---|---|")
    serial = walls[settings[0]]
    for workers in settings:
        print(f"| {workers} | {walls[workers]:.0f} | {serial / walls[workers]:.2f}x |")
    print("\n| tokens | " + " | ".join(f"winner ({w} workers)" for w in settings) + " |")
    print("|---|" + "---|" * len(settings))
    rows = {w: {r.bucket["num_tokens"]: r for r in db.read_winners(tables[w]).rows}
            for w in settings}
    for m in sorted(set().union(*(r.keys() for r in rows.values()))):
        cells = []
        for w in settings:
            r = rows[w].get(m)
            cells.append(f"{r.kernel} {r.median_us:.1f}us ({r.speedup:.2f}x)"
                         if r else "-")
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
