"""What a table of deterministic winners would keep, from a table's own trials: per bucket,
in its search (the run with the most trials there), the fastest trial of any kernel and the
fastest whose bits are the same in every call (``BaseKernel.run_to_run``), side by side; and
the table winner's speedup over vLLM's pick (from its own row) scaled by their ratio, an
estimate across two runs of what ``tune --deterministic`` would reach.

    python scripts/determinism_cost.py runtime/tables/nvidia_H100_80GB_HBM3.db [--out FILE.md]

The search spends its trials where the sampler expects gains, and atomic reduces won most of
them, so the deterministic configurations' best trial is a bound: ``tune --deterministic`` may
find faster ones.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

from moetune import db
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import default_registry

def varies(row: dict[str, Any]) -> str | None:
    """Why the trial's configuration may give other bits in another call (None: it does not;
    a kernel this install no longer has counts as varying)."""
    try:
        kernel = default_registry.get(row["kernel"])
        params = kernel.validate(row["params"])
    except Exception as e:  # an unknown kernel or params it no longer takes: not vouched for
        return str(e)
    return kernel.run_to_run(MoEProblem.from_row(row["bucket"]), params)


def bucket_rows(path: Path) -> list[dict[str, Any]]:
    """One row per bucket with a winner: its shape, M, the search's run, its fastest trial and
    its fastest deterministic trial, and the winner row's speedup over vLLM's pick."""
    speedups = {tuple(sorted(w.bucket.items())): w.speedup for w in db.read_winners(path).rows}
    runs: dict[tuple, dict[int, list[dict[str, Any]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for row in db.read_measurements(path):
        if row["status"] == "ok" and row["median_us"] and row["params"] is not None:
            runs[tuple(sorted(row["bucket"].items()))][row["run_id"]].append(row)
    out = []
    for key, by_run in runs.items():
        if speedups.get(key) is None:
            continue
        run = max(by_run, key=lambda r: (len(by_run[r]), r))
        best = min(by_run[run], key=lambda t: t["median_us"])
        steady = min((t for t in by_run[run] if varies(t) is None),
                     key=lambda t: t["median_us"], default=None)
        problem = MoEProblem.from_row(dict(key))
        out.append({"shape": problem.describe().split(" ", 1)[1], "m": problem.num_tokens,
                    "run": run, "best": best, "steady": steady, "speedup": speedups[key]})
    return sorted(out, key=lambda r: (r["shape"], r["m"]))


def report(path: Path) -> str:
    lines = [f"# Deterministic winners only: what they keep ({path.name})", "",
             "Per bucket: the search run (`run`), its fastest trial and its fastest trial whose "
             "bits are the same in every call (µs), their ratio (side by side in one run); the "
             "table winner's speedup over vLLM's pick; that speedup times the ratio (an "
             "estimate across two runs, a bound: the search did not aim at deterministic "
             "configurations; 1.000x where vLLM's own kernel would stay).", ""]
    shape = None
    for r in bucket_rows(path):
        if r["shape"] != shape:
            shape = r["shape"]
            lines += ["", f"## {shape}", "",
                      "| M | run | fastest | deterministic | kept | winner over vLLM | "
                      "deterministic over vLLM (estimate) |", "|---|---|---|---|---|---|---|"]
        best, steady = r["best"], r["steady"]
        if steady is None:
            lines.append(f"| {r['m']} | {r['run']} | {best['median_us']:.1f} ({best['kernel']}) "
                         f"| none measured | - | {r['speedup']:.3f}x | - |")
            continue
        kept = best["median_us"] / steady["median_us"]
        lines.append(f"| {r['m']} | {r['run']} | {best['median_us']:.1f} ({best['kernel']}) | "
                     f"{steady['median_us']:.1f} ({steady['kernel']}) | {kept:.3f} | "
                     f"{r['speedup']:.3f}x | {max(1.0, r['speedup'] * kept):.3f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--out", type=Path, help="write the report here too")
    args = parser.parse_args()
    text = report(args.table)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
