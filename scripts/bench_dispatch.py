"""Per-call cost of the dispatcher's hot path (``Dispatcher.select`` on a memoized problem).

Usage: python scripts/bench_dispatch.py [--calls N]
Tunes the tiny preset at three buckets on the CPU into a temporary table, then times select()
for hits, nearest-bucket hits and rule fallbacks. Prints a Markdown report.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import sys
import tempfile
import timeit
from pathlib import Path

from moetune.runtime.dispatcher import Dispatcher
from moetune.runtime.platform import detect_sku
from moetune.tuner.job import JobOptions, run_job, source_commit
from moetune.tuner.presets import preset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    sku = detect_sku("cpu")
    shape = preset("tiny").shape
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "tiny.db"
        run_job([shape.problem(m) for m in (1, 16, 64)], table, sku,
                JobOptions(trials=4, reps=3))
        dispatcher = Dispatcher.load(table, sku)
    cases = {"hit (tuned bucket)": shape.problem(16), "hit (nearest bucket)": shape.problem(7),
             "rule fallback (other shape)": dataclasses.replace(shape, hidden_size=256).problem(16)}
    print(f"# Dispatcher per-call cost\n\nmachine: {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}; date: {datetime.date.today()}; "
          f"commit: {source_commit()}\ncommand: python {' '.join(sys.argv)}\n")
    print("| case | source | us per call |\n|---|---|---|")
    for name, problem in cases.items():
        dispatcher.select(problem)  # first call decides and memoizes
        per_call = min(timeit.repeat(lambda: dispatcher.select(problem), number=args.calls,
                                     repeat=5)) / args.calls * 1e6
        print(f"| {name} | {dispatcher.select(problem).source} | {per_call:.3f} |")


if __name__ == "__main__":
    main()
