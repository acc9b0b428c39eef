"""vLLM's own pick against the old emulation of it and the shipped table's winner, per preset and
bucket, side by side in one process; then vLLM's ops between the GEMMs against the memory floor.

Usage (on a GPU where vLLM's Triton MoE path imports and its compiled ops load, e.g. carried
there with ``scripts/vllm_device_pack.py``):

    python scripts/bench_vllm_baseline.py [--presets mixtral-8x7b,...] [--buckets 1,64,4096]
        [--rounds 3] [--budget-s 400] [--commit SHA] [--json OUT.jsonl]
        [--also vllm_deepgemm,...] > report.md

With ``--json``, buckets already in that file are not measured again (a run that stopped at
its budget resumes where it stopped) and the glue section runs once all buckets are in.

Per bucket, each gated against the float32 reference first, then timed in ``--rounds`` rounds,
the three in a rotated order each round (``tuner.timing.time_op``: median over CUDA-graph
replays of 10 calls, each on its own batch):

* ``vllm``: vLLM's ``TritonExperts`` in its modular kernel (``vllm_triton``), configs chosen by
  vLLM itself: what vLLM of the installed version runs for the layer;
* ``emulated``: what moetune measured every speedup against before: aiter's fork of vLLM's
  Triton GEMM (``aiter_triton``) with vLLM's config as moetune read it, torch glue between;
* ``winner``: the shipped table's winner for the bucket (``runtime/tables/<SKU>.db``);
* ``--also``: more kernels by registry name (their seed parameters), e.g. ``vllm_deepgemm``:
  vLLM's DeepGEMM experts, timed in the same rotation and reported in a table of their own, with
  the reason where one is not eligible and the wall time of its first call (a JIT compile).

A ratio is the median of the per-round ratios. The glue section times vLLM's own compiled ops
(``silu_and_mul``, ``moe_sum``, ``moe_align_block_size``) and the prepare step's fp8 activation
quantization at each preset's sizes, against the HBM bandwidth measured in the same process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from typing import Any

import torch

from moetune.db import read_winners
from moetune.runtime.dispatcher import shipped_table
from moetune.runtime.kernels.triton_config import vllm_config_variants
from moetune.runtime.platform import SKU, detect_sku, environment
from moetune.runtime.problem import DEFAULT_BUCKETS, MoEProblem
from moetune.runtime.registry import default_registry
from moetune.runtime.vllm.triton import vllm_triton
from moetune.tuner import roofline
from moetune.tuner.gate import relative_error, tolerance
from moetune.tuner.inputs import make_batch, make_weights
from moetune.tuner.presets import preset
from moetune.tuner.timing import time_op

PRESETS = ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "llama-4-maverick")
#: The four presets of the speedup goal (Qwen3-235B is reported, not in the goal's geomean).
GOAL = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "llama-4-maverick")
GRAPH_CALLS = 10
KEYS = ("vllm", "emulated", "winner")


def table_winners(sku: SKU) -> dict[tuple[str, int], dict[str, Any]]:
    """The shipped table's rows for ``sku`` by (shape key, bucket), whatever their verdict."""
    out = {}
    for row in read_winners(shipped_table(sku)).rows:
        if (row.sku["vendor"], row.sku["name"]) != (sku.vendor.value, sku.name):
            continue
        problem = MoEProblem.from_row(row.bucket)
        out[(repr(problem.shape), problem.num_tokens)] = {
            "kernel": row.kernel, "params": row.params, "stored_speedup": row.speedup,
            "stored_us": row.median_us}
    return out


def candidates(problem: MoEProblem, sku: SKU, row: dict[str, Any] | None,
               also: tuple[str, ...] = ()) -> dict[str, tuple[str, dict[str, Any]]]:
    emulated = vllm_config_variants(problem, sku)[0][0]
    out = {"vllm": ("vllm_triton", {}), "emulated": ("aiter_triton", emulated)}
    if row is not None:
        out["winner"] = (row["kernel"], row["params"])
    for name in also:
        out[name] = (name, default_registry.get(name).seed_params(problem, sku) or {})
    return out


def prepared(problem: MoEProblem, kernel: str, params: dict[str, Any], weights: Any,
             inputs: list, ref: torch.Tensor) -> tuple[Any, dict[str, Any]]:
    """The callable, gated, or None with why not."""
    record: dict[str, Any] = {"kernel": kernel, "params": params}
    try:
        fn = default_registry.get(kernel).prepare(problem, params, weights)
        start = time.perf_counter()
        got = fn(*inputs[0])
        torch.cuda.synchronize()
        record["first_call_s"] = time.perf_counter() - start  # a JIT compile, where one runs
        err = relative_error(got, ref)
        record["error"] = err
        if not err <= tolerance(problem):
            record["skipped"] = f"relative error {err:.3g} > {tolerance(problem)}"
            return None, record
        return fn, record
    except Exception as e:  # noqa: BLE001 - one kernel failing is a result
        record["skipped"] = f"{type(e).__name__}: {str(e)[:300]}"
        return None, record


def timed_rounds(fns: dict[str, Any], inputs: list, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for r in range(rounds):
        for key in order[r % len(order):] + order[:r % len(order)]:
            t = time_op(fns[key], inputs, "cuda", warmup=3, reps=10, graph_calls=GRAPH_CALLS)
            times[key].append(t.median_us)
    return times


def bench_bucket(name: str, problem: MoEProblem, sku: SKU, weights: Any,
                 row: dict[str, Any] | None, rounds: int,
                 also: tuple[str, ...] = ()) -> dict[str, Any]:
    inputs = [make_batch(problem, "cuda", seed=1000 * problem.num_tokens + i).args()
              for i in range(GRAPH_CALLS)]
    ref = default_registry.get("reference").prepare(problem, {}, weights)(*inputs[0])
    fns, records = {}, {}
    for key, (kernel, params) in candidates(problem, sku, row, also).items():
        ok, why = default_registry.get(kernel).supports(problem, sku) if key in also else (True, None)
        if not ok:
            records[key] = {"kernel": kernel, "params": params, "skipped": why}
            continue
        fn, records[key] = prepared(problem, kernel, params, weights, inputs, ref)
        if fn is not None:
            fns[key] = fn
    times = timed_rounds(fns, inputs, rounds)
    for key, ts in times.items():
        records[key]["us"] = statistics.median(ts)
        records[key]["rounds_us"] = ts
    for key in ("emulated", "winner", *also):
        for base in ("vllm", "winner"):
            if key in times and base in times and key != base:
                records[key][f"over_{base}"] = statistics.median(
                    v / t for v, t in zip(times[base], times[key]))
    if row is not None:
        records.setdefault("winner", {})["stored_speedup"] = row["stored_speedup"]
    return {"preset": name, "tokens": problem.num_tokens, **records}


def glue(problem: MoEProblem, hbm: float) -> list[dict[str, Any]]:
    """vLLM's ops between the GEMMs at ``problem``'s sizes: time, bytes moved, fraction of HBM."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size

    m, k, h, i, e = (problem.num_tokens, problem.topk, problem.hidden_size,
                     problem.intermediate_size, problem.num_experts)
    dt = torch.bfloat16
    gate_up = torch.randn(m * k, 2 * i, dtype=dt, device="cuda")
    act = torch.empty(m * k, i, dtype=dt, device="cuda")
    rows = torch.randn(m, k, h, dtype=dt, device="cuda")
    summed = torch.empty(m, h, dtype=dt, device="cuda")
    ids = make_batch(problem, "cuda", seed=7).topk_ids
    x = torch.randn(m, h, dtype=dt, device="cuda")
    ops_ = {
        "silu_and_mul": (lambda: torch.ops._C.silu_and_mul(act, gate_up), 3 * m * k * i * 2),
        "moe_sum": (lambda: ops.moe_sum(rows, summed), (k + 1) * m * h * 2),
        "moe_align_block_size": (lambda: moe_align_block_size(ids, 64, e), m * k * 4 * 2),
    }
    if problem.quant.is_fp8:
        from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

        block = [128, 128] if problem.quant.value == "fp8_block_128x128" else None
        per_token = problem.quant.value == "fp8_per_channel"
        ops_["quantize_input"] = (
            lambda: moe_kernel_quantize_input(x, None, torch.float8_e4m3fn, per_token, block),
            m * h * 3)
    out = []
    for op, (fn, nbytes) in ops_.items():
        t = time_op(lambda *_: fn(), [()] * GRAPH_CALLS, "cuda", warmup=3, reps=20,
                    graph_calls=GRAPH_CALLS).median_us
        out.append({"op": op, "tokens": m, "us": t, "bytes": nbytes,
                    "hbm_fraction": nbytes / (t * 1e-6) / hbm})
    return out


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--buckets", default=",".join(map(str, DEFAULT_BUCKETS)))
    parser.add_argument("--glue-tokens", default="1,64,512,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=420)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--json", default=None)
    parser.add_argument("--also", default="",
                        help="more kernels to time beside vLLM's pick, by registry name")
    args = parser.parse_args()
    also = tuple(n for n in args.also.split(",") if n)
    deadline = time.monotonic() + args.budget_s
    code, why = vllm_triton()
    if code is None:
        print(f"error: vLLM's Triton MoE path cannot run here: {why}", file=sys.stderr)
        return 1
    sku = detect_sku("cuda")
    rows = table_winners(sku)
    ceilings = roofline.measure_ceilings("cuda")
    env = environment()
    done = _done(args.json)
    log = open(args.json, "a") if args.json else None
    print(f"# vLLM {code.version}'s pick, the old emulated pick and the table's winner on "
          f"{sku.label()}\n\n{datetime.date.today()}, commit {args.commit}; torch "
          f"{env.get('torch')}, triton {env.get('triton')}; {ceilings.describe()}; "
          f"`{' '.join(sys.argv)}`\n")
    print("| preset | M | vLLM us | emulated us | emulated / vLLM (time) | winner | winner us | "
          "winner over vLLM | stored speedup (over emulated) |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary: dict[str, list[float]] = {}
    results: list[dict[str, Any]] = []
    for name in args.presets.split(","):
        shape = preset(name).shape
        buckets = [int(t) for t in args.buckets.split(",")]
        if all((name, m) in done for m in buckets) or time.monotonic() > deadline:
            weights = None
        else:
            weights = make_weights(shape.problem(1), "cuda", seed=0)
        for m in buckets:
            problem = shape.problem(m)
            result = done.get((name, m))
            if result is None and (weights is None or time.monotonic() > deadline):
                print(f"| {name} | {m} | not measured: budget spent |" + " |" * 6)
                continue
            if result is None:
                result = bench_bucket(name, problem, sku, weights, rows.get((repr(shape), m)),
                                      args.rounds, also)
                if log:
                    log.write(json.dumps(result) + "\n")
                    log.flush()
            print(_line(result))
            sys.stdout.flush()
            if "over_vllm" in result.get("winner", {}):
                summary.setdefault(name, []).append(result["winner"]["over_vllm"])
            results.append(result)
            torch.cuda.empty_cache()
        del weights
        torch.cuda.empty_cache()
    print("\n| preset | buckets | geomean winner over vLLM | served (a bucket the winner "
          "loses runs vLLM's pick: 1.0) |\n|---|---|---|---|")
    for name, ratios in summary.items():
        print(f"| {name} | {len(ratios)} | {geomean(ratios):.3f}x | "
              f"{geomean([max(r, 1.0) for r in ratios]):.3f}x |")
    goal = [r for n in GOAL for r in summary.get(n, [])]
    print(f"\nOver the goal's presets: {geomean(goal):.3f}x raw, "
          f"{geomean([max(r, 1.0) for r in goal]):.3f}x served.\n")
    if also:
        print(_also_table(results, also))
    if time.monotonic() > deadline:
        print("The glue section runs once every bucket is measured.")
        return 0
    print("## vLLM's ops between the GEMMs\n\n| preset | op | M | us | MB moved | HBM fraction |"
          "\n|---|---|---|---|---|---|")
    for name in args.presets.split(","):
        shape = preset(name).shape
        for m in (int(t) for t in args.glue_tokens.split(",")):
            for g in glue(shape.problem(m), ceilings.hbm_bytes_per_s):
                if log:
                    log.write(json.dumps({"preset": name, "glue": g}) + "\n")
                print(f"| {name} | {g['op']} | {m} | {g['us']:.1f} | {g['bytes'] / 1e6:.2f} | "
                      f"{g['hbm_fraction']:.2f} |")
    return 0


def _done(path: str | None) -> dict[tuple[str, int], dict[str, Any]]:
    """Buckets an earlier run of the same ``--json`` file measured: a run resumes there."""
    try:
        with open(path or "") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return {}
    return {(r["preset"], r["tokens"]): r for r in records if "tokens" in r}


def _also_table(results: list[dict[str, Any]], also: tuple[str, ...]) -> str:
    """The ``--also`` kernels per bucket: time, against vLLM's pick and the table's winner."""
    lines = ["## More kernels (--also)\n", "| preset | M | kernel | us | over vLLM | over winner "
             "| first call s | error |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for key in also:
            rec = r.get(key, {})
            if "us" not in rec:
                lines.append(f"| {r['preset']} | {r['tokens']} | {key} | "
                             f"({rec.get('skipped', 'not measured')[:120]}) | | | | |")
                continue
            over = [f"{rec[k]:.3f}x" if k in rec else "-" for k in ("over_vllm", "over_winner")]
            lines.append(f"| {r['preset']} | {r['tokens']} | {key} | {rec['us']:.1f} | "
                         f"{over[0]} | {over[1]} | {rec.get('first_call_s', 0):.1f} | "
                         f"{rec.get('error', float('nan')):.3g} |")
    return "\n".join(lines) + "\n"


def _line(r: dict[str, Any]) -> str:
    def us(key: str) -> str:
        rec = r.get(key, {})
        return f"{rec['us']:.1f}" if "us" in rec else f"({rec.get('skipped', '-')[:60]})"

    def ratio(value: float | None) -> str:
        return f"{value:.3f}x" if value else "-"

    emulated = r.get("emulated", {}).get("over_vllm")
    win = r.get("winner", {})
    return (f"| {r['preset']} | {r['tokens']} | {us('vllm')} | {us('emulated')} | "
            f"{ratio(emulated and 1 / emulated)} | {win.get('kernel', '-')} | {us('winner')} | "
            f"{ratio(win.get('over_vllm'))} | {ratio(win.get('stored_speedup'))} |")


if __name__ == "__main__":
    sys.exit(main())
