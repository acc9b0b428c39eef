"""Time loading a large table the way every vLLM process does (``Dispatcher.load``).

Usage: python scripts/bench_table_load.py [--rows 10000] [--repeat 5] [--profile]
For a side-by-side with an older commit, check it out as ``DIR/moetune`` (``git worktree add
DIR/moetune REF``) and run this script again with ``PYTHONPATH=DIR`` right after.
Writes a table of ``--rows`` measured winners for this machine's SKU (distinct buckets of many
shapes, each timed against today's CPU rule), then times, each in fresh calls: ``read_winners``
alone; ``Dispatcher.load``; the first ``select`` of one shape after a load (where a load that
judges rows per shape does that shape's work); and a load whose ``status`` is then read (every
row judged, as ``MOETUNE_MODE=strict`` does at startup). Prints Markdown.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import datetime
import platform
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetune import db
from moetune.runtime.dispatcher import Dispatcher
from moetune.runtime.platform import detect_sku, environment
from moetune.runtime.problem import DEFAULT_BUCKETS, MoEProblem
from moetune.runtime.rules import rule_choice
from moetune.tuner.job import source_commit


def problem_of(i: int) -> MoEProblem:
    """Row ``i``'s bucket: 18 buckets per shape, shapes differing in hidden and intermediate."""
    shape_id = i // len(DEFAULT_BUCKETS)
    return MoEProblem(DEFAULT_BUCKETS[i % len(DEFAULT_BUCKETS)], 128 * (1 + shape_id % 64),
                      256 * (1 + shape_id // 64), 8, 2)


def write_rows(path: Path, rows: int) -> None:
    """``rows`` measured winners of distinct buckets, all for this machine's SKU."""
    sku = detect_sku("cpu")
    with db.write_table(path) as table, table.session() as s:
        sku_row = db.get_or_create_sku(s, sku.vendor.value, sku.name, sku.arch,
                                       sku.compute_units, sku.memory_bytes)
        run = db.start_run(s, sku_row, environment=environment(), command="bench", commit=None,
                           driver=None)
        for i in range(rows):
            problem = problem_of(i)
            rule = rule_choice(problem, sku)
            bucket = db.get_or_create_bucket(s, **problem.to_row())
            base: Any = [{"kernel": rule.kernel, "params": rule.params, "median_us": 20.0,
                          "p20_us": 19.0, "p80_us": 21.0, "rounds": 5, "ratio_lo": 1.9,
                          "ratio_hi": 2.1, "beaten": True}]
            if hasattr(db, "BaselineRecord"):  # typed from schema 0007 on
                base = (db.BaselineRecord(db.Candidate(rule.kernel, rule.params), rule.vllm,
                                          rule.configs, 20.0, 19.0, 21.0, 5, 1.9, 2.1, True),)
            # Tables from before schema 0003 have no baselines (``--compare`` runs old code).
            extra = {"baselines": base} if "baselines" in inspect.signature(
                db.set_winner).parameters else {}
            db.set_winner(s, sku_row, bucket, run, "torch_grouped", {}, 10.0, 9.5, 10.5, 1e-3,
                          rule.kernel, rule.params, 20.0, **extra)
        db.finish_run(s, run, db.RunStatus.FINISHED)


def best_of(measure: Callable[[], float], repeat: int) -> tuple[float, float]:
    """Best and median ms of ``repeat`` calls of ``measure`` (which returns seconds)."""
    times = [measure() for _ in range(repeat)]
    return min(times) * 1e3, statistics.median(times) * 1e3


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    sku = detect_sku("cpu")
    problem = problem_of(args.rows // 2)  # a shape in the middle of the table

    def first_select(path: Path) -> float:
        loaded = Dispatcher.load(path, sku)
        return timed(lambda: loaded.select(problem))

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.db"
        write_rows(path, args.rows)
        loaded = Dispatcher.load(path, sku)
        assert loaded.select(problem).source == "table", loaded.select(problem)
        assert loaded.status.usable and loaded.status.rows == args.rows, loaded.status
        read = best_of(lambda: timed(lambda: db.read_winners(path)), args.repeat)
        load = best_of(lambda: timed(lambda: Dispatcher.load(path, sku)), args.repeat)
        select = best_of(lambda: first_select(path), args.repeat)
        whole = best_of(lambda: timed(lambda: Dispatcher.load(path, sku).status), args.repeat)
        if args.profile:
            cProfile.runctx("Dispatcher.load(path, sku).select(problem)", globals(), locals(),
                            "/tmp/load.prof")
            pstats.Stats("/tmp/load.prof").sort_stats("cumulative").print_stats(25)
    print(f"# Table load, {args.rows} rows\n")
    print(f"- machine: {platform.processor() or platform.machine()}, {sku.label()}, "
          f"Python {platform.python_version()}")
    print(f"- date: {datetime.date.today()}, commit {source_commit()}")
    print(f"- command: python scripts/bench_table_load.py --rows {args.rows} --repeat "
          f"{args.repeat}\n")
    print("| step | best ms | median ms |\n|---|---|---|")
    print(f"| read_winners (SQLite -> plain rows) | {read[0]:.1f} | {read[1]:.1f} |")
    print(f"| Dispatcher.load | {load[0]:.1f} | {load[1]:.1f} |")
    print(f"| first select of one shape, after load | {select[0]:.1f} | {select[1]:.1f} |")
    print(f"| load + status (every row judged, as strict) | {whole[0]:.1f} | {whole[1]:.1f} |")


if __name__ == "__main__":
    main()
