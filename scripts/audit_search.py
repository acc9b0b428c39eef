"""How close the tuner's search gets to exhaustive search, measured once and replayed offline.

``time`` (on the GPU) times whole Triton config grids of one preset's buckets into a JSON-lines
store, every config gated against the reference like any tuning candidate:

- ``aiter_triton`` (one config for both GEMMs, as vLLM runs it): all of vLLM's 1920-config
  space that fits in shared memory;
- ``aiter_triton_silu_fused`` (a config per GEMM, 1920 x 1920 pairs): GEMM1's whole grid with
  GEMM2 at ``aiter_triton``'s best config, then GEMM2's whole grid with GEMM1 at the best of
  that sweep. A pair off the two sweeps is modeled as additive,
  ``t(g1, g2) = t(g1, g2*) + t(g1*, g2) - t(g1*, g2*)``, and that model is checked on random
  pairs and its own best pairs, timed directly;
- the rule's variants, each family's seed and the shipped table's winner, for reference;
- the fastest few of each grid again with full repetitions (grid timings use few).

It is resumable: configs already in the store are skipped, and ``--deadline-s`` stops it
cleanly, so a run can be spread over several calls.

``replay`` (anywhere, no GPU) runs the tuner's own ``search`` against the store, for the
samplers' seeds, trial budgets and compile-ahead batch sizes asked for, and writes Markdown:
how often, and after how many evaluations, the search reaches 99% of the exhaustive best.

    python scripts/audit_search.py time --preset qwen3-30b-a3b --buckets 1,64,2048 \\
        --store bench/results/audit-h200/store.jsonl
    python scripts/audit_search.py replay --store bench/results/audit-h200/store.jsonl \\
        > bench/results/audit-h200/README.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import itertools
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from moetune import db
from moetune.runtime.kernels.base import BaseKernel, params_key
from moetune.runtime.kernels.triton_config import SPACE, with_prefix
from moetune.runtime.platform import SKU, detect_sku, environment
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import rule_variants
from moetune.tuner.measure import Result, Status
from moetune.tuner.shapes import ShapeOptions, resolve
from moetune.tuner.timing import Timing

Key = tuple[str, str]
ONE, SPLIT = "aiter_triton", "aiter_triton_silu_fused"
#: Pairs off the sweeps timed directly to check the additive model: random ones, and the
#: model's fastest.
RANDOM_PAIRS = 24
MODEL_BEST_PAIRS = 8
POLISH = 10
POLISH_REPS = 20


# --- the store -------------------------------------------------------------------------------
class Store:
    """Append-only JSON lines: a header, then one result per (bucket, kernel, params, phase).
    A ``.gz`` store is read compressed (how a finished one is committed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header: dict[str, Any] = {}
        self.results: dict[tuple[int, str], dict[Key, Result]] = {}
        if path.exists():
            text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" \
                else path.read_text()
            for line in text.splitlines():
                if line.strip():
                    self._take(json.loads(line))

    def _take(self, row: dict[str, Any]) -> None:
        if row["kind"] == "header":
            self.header = row
            return
        timing = None if row["median_us"] is None else Timing(
            row["median_us"], row["p20_us"], row["p80_us"], row["samples"], row["method"])
        result = Result(row["kernel"], row["params"], Status(row["status"]), timing,
                        row["error"], row["reason"])
        self.results.setdefault((row["bucket"], row["phase"]), {})[
            (row["kernel"], params_key(row["params"]))] = result

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        self._take(row)

    def add(self, bucket: int, phase: str, result: Result) -> None:
        t = result.timing
        self.write({"kind": "result", "bucket": bucket, "phase": phase, "kernel": result.kernel,
                    "params": result.params, "status": result.status.value,
                    "median_us": t and t.median_us, "p20_us": t and t.p20_us,
                    "p80_us": t and t.p80_us, "samples": t and t.samples,
                    "method": t and t.method, "error": result.error, "reason": result.reason})

    def phase(self, bucket: int, phase: str) -> dict[Key, Result]:
        return self.results.get((bucket, phase), {})

    def timed(self, bucket: int) -> dict[Key, Result]:
        """Every result of a bucket, a polished (fully repeated) timing over a grid's."""
        merged: dict[Key, Result] = {}
        for (b, phase), results in sorted(self.results.items(), key=lambda i: i[0][1] == "polish"):
            if b == bucket:
                merged.update(results)
        return merged


def fastest(results: Iterable[Result], kernel: str) -> Result | None:
    ok = [r for r in results if r.kernel == kernel and r.status is Status.OK]
    return min(ok, key=lambda r: r.median_us, default=None)


# --- what ``time`` measures ----------------------------------------------------------------
def one_grid(problem: MoEProblem) -> list[dict[str, Any]]:
    """vLLM's grid as ``aiter_triton`` params, the configs that cannot fit left out."""
    kernel = default_registry.get(ONE)
    points = (dict(zip(SPACE, values)) for values in itertools.product(*SPACE.values()))
    return [p for p in points if kernel.check_params(problem, p) is None]


def sweep(problem: MoEProblem, fixed: dict[str, int], gemm: str) -> list[dict[str, Any]]:
    """The silu family's params with ``gemm`` ("g1_"/"g2_") over the grid, the other fixed."""
    other = "g2_" if gemm == "g1_" else "g1_"
    kernel = default_registry.get(SPLIT)
    pairs = (with_prefix(c, gemm) | with_prefix(fixed, other) for c in one_grid(problem))
    return [p for p in pairs if kernel.check_params(problem, p) is None]


def split_configs(params: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    return ({k[3:]: v for k, v in params.items() if k.startswith("g1_")},
            {k[3:]: v for k, v in params.items() if k.startswith("g2_")})


class PairModel:
    """The silu family's time at any pair, from its two sweeps (see the module docstring)."""

    def __init__(self, g1_sweep: Iterable[Result], g2_sweep: Iterable[Result]) -> None:
        self.g1 = {params_key(split_configs(r.params)[0]): _time(r) for r in g1_sweep}
        self.g2 = {params_key(split_configs(r.params)[1]): _time(r) for r in g2_sweep}
        self.anchor = min(self.g1.values(), default=math.inf)

    @classmethod
    def of(cls, store: Store, bucket: int) -> PairModel:
        return cls(store.phase(bucket, "g1").values(), store.phase(bucket, "g2").values())

    def __call__(self, params: dict[str, Any]) -> float | None:
        g1, g2 = split_configs(params)
        a, b = self.g1.get(params_key(g1)), self.g2.get(params_key(g2))
        return None if a is None or b is None else a + b - self.anchor

    def best_pairs(self, n: int) -> list[dict[str, Any]]:
        """The ``n`` pairs the model ranks fastest (the sweeps' best crossed)."""
        top1 = sorted(self.g1, key=self.g1.__getitem__)[:n]
        top2 = sorted(self.g2, key=self.g2.__getitem__)[:n]
        pairs = sorted((self.g1[a] + self.g2[b], a, b) for a in top1 for b in top2)
        return [with_prefix(json.loads(a), "g1_") | with_prefix(json.loads(b), "g2_")
                for _, a, b in pairs[:n]]


def _time(result: Result) -> float:
    return result.median_us if result.status is Status.OK else math.inf


def references(problem: MoEProblem, sku: SKU, table: Path) -> list[tuple[str, dict[str, Any]]]:
    """The rule's variants, both families' seeds and the shipped table's winner."""
    picks = [(v.kernel, v.params) for v in rule_variants(problem, sku)]
    for name in (ONE, SPLIT):
        seed = default_registry.get(name).seed_params(problem, sku)
        if seed is not None:
            picks.append((name, seed))
    if table.exists():
        for row in db.read_winners(table).rows:
            if SKU.row_key(row.sku) == sku.key and MoEProblem.from_row(row.bucket) == problem:
                picks.append((row.kernel, row.params))
    return picks


def random_pairs(problem: MoEProblem, n: int, seed: int) -> list[dict[str, Any]]:
    grid = one_grid(problem)
    rng = random.Random(seed)
    kernel = default_registry.get(SPLIT)
    pairs: list[dict[str, Any]] = []
    while len(pairs) < n:
        p = with_prefix(rng.choice(grid), "g1_") | with_prefix(rng.choice(grid), "g2_")
        if kernel.check_params(problem, p) is None:
            pairs.append(p)
    return pairs


def cmd_time(args: argparse.Namespace) -> None:
    from moetune.tuner.procs.compile_pool import CompilePool
    from moetune.tuner.procs.measurer import IsolatedMeasurer

    deadline = time.monotonic() + args.deadline_s
    shape, _ = resolve(ShapeOptions(preset=args.preset))
    sku = detect_sku(args.device)
    device = "cpu" if sku.vendor.value == "cpu" else "cuda"
    store = Store(args.store)
    if not store.header:
        store.write({"kind": "header", "preset": args.preset, "sku": sku.to_row(),
                     "environment": environment(), "date": str(datetime.date.today()),
                     "commit": args.commit, "reps": args.reps, "polish_reps": POLISH_REPS,
                     "command": " ".join(sys.argv)})
    problems = [shape.problem(int(m)) for m in args.buckets.split(",")]
    pool = CompilePool(problems[0], device, default_registry, workers=args.workers)
    grid_timer = IsolatedMeasurer(problems[0], device, default_registry, reps=args.reps)
    try:
        for problem in problems:  # bucket by bucket: a switch rebuilds the children's inputs
            m = problem.num_tokens
            switched = False
            for phase in PHASES:
                todo = _phase_todo(store, problem, sku, phase, args.table)
                if todo is None:
                    break
                done = store.phase(m, phase)
                todo = [c for c in todo if (c[0], params_key(c[1])) not in done]
                if todo and not switched:
                    pool.switch(problem)
                    grid_timer.switch(problem)
                    switched = True
                start = time.perf_counter()
                for batch in _chunks(todo, 8 * pool.workers):
                    if time.monotonic() > deadline:
                        print(f"deadline: stopped in M={m} {phase}", file=sys.stderr)
                        return
                    failed = pool.compile(batch)
                    for (kernel, params), why in zip(batch, failed):
                        if why:
                            result = Result(kernel, params, Status.FAILED,
                                            reason=f"compiling ahead: {why}")
                        elif phase == "polish":
                            result = Result(kernel, params, Status.OK,
                                            grid_timer.retime(kernel, params, POLISH_REPS))
                        else:
                            result = grid_timer.measure(kernel, params)
                        store.add(m, phase, result)
                if todo:
                    print(f"M={m} {phase}: {len(todo)} configs in "
                          f"{time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)
    finally:
        pool.close()
        grid_timer.close()


PHASES = ("reference", "one", "g1", "g2", "pairs", "polish")


def _phase_todo(store: Store, problem: MoEProblem, sku: SKU, phase: str,
                table: Path) -> list[tuple[str, dict[str, Any]]] | None:
    """The configs of ``phase`` for ``problem``, or None while an earlier phase is unfinished
    (each grid is centred on the best of the one before)."""
    m = problem.num_tokens
    if phase == "reference":
        return references(problem, sku, table)
    if phase == "one":
        return [(ONE, p) for p in one_grid(problem)]
    previous = PHASES[PHASES.index(phase) - 1]
    before = _phase_todo(store, problem, sku, previous, table)
    if before is None or any((k, params_key(p)) not in store.phase(m, previous)
                             for k, p in before):
        return None
    if phase == "g1":
        return [(SPLIT, p) for p in sweep(problem, fastest(store.phase(m, "one").values(), ONE)
                                          .params, "g1_")]
    if phase == "g2":
        best = fastest(store.phase(m, "g1").values(), SPLIT)
        return [(SPLIT, p) for p in sweep(problem, split_configs(best.params)[0], "g2_")]
    if phase == "pairs":
        return [(SPLIT, p) for p in PairModel.of(store, m).best_pairs(MODEL_BEST_PAIRS)
                + random_pairs(problem, RANDOM_PAIRS, seed=m)]
    every = store.timed(m)
    polish = [(r.kernel, r.params) for r in store.phase(m, "reference").values()
              if r.status is Status.OK]
    for kernel in (ONE, SPLIT):
        ok = sorted((r for r in every.values() if r.kernel == kernel and r.status is Status.OK),
                    key=lambda r: r.median_us)
        polish += [(r.kernel, r.params) for r in ok[:POLISH]]
    return polish


def _chunks(items: list[Any], n: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


# --- replay ----------------------------------------------------------------------------------
class ReplayMeasurer:
    """The tuner's measurer interface answered from the store (the silu family's pairs off its
    sweeps by the additive model); ``calls`` keeps the answers in the order asked."""

    def __init__(self, timed: dict[Key, Result], model: PairModel) -> None:
        self.timed, self.model = timed, model
        self.calls: list[Result] = []
        self.misses = 0

    def measure(self, kernel: str, params: dict[str, Any],
                cutoff_us: float | None = None) -> Result:
        result = self.timed.get((kernel, params_key(params)))
        modeled = self.model(params) if result is None and kernel == SPLIT else None
        if modeled is not None:
            result = Result(kernel, params, Status.OK, Timing(modeled, modeled, modeled, 1,
                                                              "modeled")) \
                if math.isfinite(modeled) else Result(kernel, params, Status.FAILED,
                                                      reason="a GEMM's config failed")
        if result is None:
            self.misses += 1
            result = Result(kernel, params, Status.FAILED, reason="not in the audit's store")
        self.calls.append(result)
        return result

    def retime(self, kernel: str, params: dict[str, Any], reps: int) -> Timing:
        raise NotImplementedError("the replay audits the search, not the confirmation")


class Batches:
    """What ``search`` needs of a compile pool: its batch size (compiling is free here)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def compile(self, candidates: list[Any]) -> list[None]:
        return [None] * len(candidates)


def cmd_replay(args: argparse.Namespace) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store = Store(args.store)
    header = store.header
    sku = SKU.from_row(header["sku"])
    if args.without_tuned_files:  # a GPU name no tuned file is for: vLLM's default config rules
        sku = dataclasses.replace(sku, name=f"{sku.name} without tuned files")
    shape, _ = resolve(ShapeOptions(preset=header["preset"]))
    trials = [int(t) for t in args.trials.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    refines = [int(r) for r in args.refine.split(",")]
    buckets = sorted({b for b, _ in store.results})
    rule = "vLLM's default config" if args.without_tuned_files else "vLLM's tuned-file config"
    out = [f"# Search audit: {header['preset']} on {SKU.from_row(header['sku']).label()}, "
           f"the rule's pick {rule}", "",
           f"- timed {header['date']} at commit {header['commit']}; grid repetitions "
           f"{header['reps']}, the fastest {POLISH} of each family and the references again "
           f"with {header['polish_reps']}",
           f"- environment: `{json.dumps(header['environment'], sort_keys=True)}`",
           f"- timing command: `{header['command']}`",
           f"- replay command: `python scripts/audit_search.py {' '.join(sys.argv[1:])}` "
           f"({datetime.date.today()})", ""]
    for m in buckets:
        problem = shape.problem(m)
        timed = store.timed(m)
        model = PairModel.of(store, m)
        out += _bucket_section(store, problem, sku, timed, model)
        for family in ([ONE], [ONE, SPLIT]):
            kernels = [default_registry.get(k) for k in family]
            best = min((_time(r) for r in timed.values() if r.kernel in family), default=math.inf)
            out += [f"#### Search over {' + '.join(family)}: exhaustive best {best:.1f} us", "",
                    "| trials | local search | batch | within 1% (of seeds) | "
                    "found/best: median, worst | evaluations to 1%: median, max | evaluations "
                    "| misses |",
                    "|---|---|---|---|---|---|---|---|"]
            for t, refine, b in itertools.product(trials, refines, batches):
                runs = [_replay(problem, sku, kernels, timed, model, t, refine, s, b, best)
                        for s in range(args.seeds)]
                hit = [r[1] for r in runs if r[1] is not None]
                ratios = [best / r[0] for r in runs]
                out.append(
                    f"| {t} | {refine} | {b} | {len(hit)}/{len(runs)} | {statistics.median(ratios):.3f}, "
                    f"{min(ratios):.3f} | "
                    + (f"{statistics.median(hit):.0f}, {max(hit)}" if hit else "-")
                    + f" | {statistics.mean(r[2] for r in runs):.0f} | {sum(r[3] for r in runs)} |")
            out.append("")
    print("\n".join(out))


def _replay(problem: MoEProblem, sku: SKU, kernels: list[type[BaseKernel]],
            timed: dict[Key, Result], model: PairModel, trials: int, refine: int, seed: int,
            batch: int, best: float) -> tuple[float, int | None, int, int]:
    """One replayed search: (found, evaluations until within 1% of ``best`` or None,
    evaluations, misses)."""
    from moetune.tuner.search import search

    measurer = ReplayMeasurer(timed, model)
    search(problem, sku, measurer, kernels, trials=trials, refine=refine, seed=seed,
           compiler=Batches(batch) if batch > 1 else None)
    times = [_time(r) for r in measurer.calls]
    first = next((i + 1 for i, t in enumerate(itertools.accumulate(times, min))
                  if t <= best * 1.01), None)
    return min(times, default=math.inf), first, len(times), measurer.misses


def _bucket_section(store: Store, problem: MoEProblem, sku: SKU, timed: dict[Key, Result],
                    model: PairModel) -> list[str]:
    m = problem.num_tokens
    lines = [f"### M={m} ({problem.describe()})", ""]
    counts = {phase: len(store.phase(m, phase)) for phase in PHASES}
    failed = {phase: sum(r.status is not Status.OK for r in store.phase(m, phase).values())
              for phase in PHASES}
    lines.append("Timed: " + ", ".join(f"{phase} {counts[phase]} ({failed[phase]} failed or "
                                       f"wrong)" for phase in PHASES if counts[phase]) + ".")
    refs = store.phase(m, "reference")
    polished = store.phase(m, "polish")
    lines += ["", "| reference | kernel | us (polished) |", "|---|---|---|"]
    names = {}
    for v in rule_variants(problem, sku):
        names[(v.kernel, params_key(v.params))] = f"rule variant: {v.reason}"
    for key, r in refs.items():
        r = polished.get(key, r)
        lines.append(f"| {names.get(key, 'seed or shipped winner')} | {r.kernel} | "
                     f"{_time(r):.1f} |")
    pairs = store.phase(m, "pairs")
    errors = [(r.median_us, model(r.params)) for r in pairs.values()
              if r.status is Status.OK and model(r.params) is not None]
    if errors:
        rel = [abs(p - t) / t for t, p in errors if math.isfinite(p)]
        lines += ["", f"Additive pair model on {len(rel)} pairs timed directly: median error "
                      f"{statistics.median(rel):.1%}, max {max(rel):.1%}."]
    lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("time", help="time the grids on this machine's GPU into the store")
    t.add_argument("--preset", default="qwen3-30b-a3b")
    t.add_argument("--buckets", default="1,64,2048")
    t.add_argument("--store", type=Path, required=True)
    t.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    t.add_argument("--workers", type=int, default=15, help="compile-ahead children")
    t.add_argument("--reps", type=int, default=3, help="timed repetitions per grid config")
    t.add_argument("--deadline-s", type=float, default=math.inf,
                   help="stop cleanly after this many seconds (resume with the same command)")
    t.add_argument("--table", type=Path, default=Path("runtime/tables/nvidia_H200.db"),
                   help="the shipped table whose winners are timed for reference")
    t.add_argument("--commit", default="unknown", help="the commit timed (for the header)")
    r = sub.add_parser("replay", help="replay the tuner's search against the store")
    r.add_argument("--store", type=Path, required=True)
    r.add_argument("--trials", default="16,24,48")
    r.add_argument("--refine", default="0,32", help="local-search budgets after the trials")
    r.add_argument("--batches", default="1,8")
    r.add_argument("--seeds", type=int, default=4)
    r.add_argument("--without-tuned-files", action="store_true",
                   help="search as on a GPU vLLM has no tuned file for (its default config rules)")
    args = parser.parse_args()
    {"time": cmd_time, "replay": cmd_replay}[args.command](args)


if __name__ == "__main__":
    main()
