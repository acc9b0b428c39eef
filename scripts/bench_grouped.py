"""moetune_grouped against the shipped table's winner and vLLM's pick, at the same tiles, with
the top-k reduce fused (atomics) and not (vLLM's separate sum), on one GPU.

Usage: VLLM_TUNED_CONFIG_FOLDER=/path/to/vllm/fused_moe/configs \\
       python scripts/bench_grouped.py [--presets qwen3-30b-a3b,...] [--tokens 256,1024,4096]
           [--budget-s 300] [--commit SHA] [--json OUT.jsonl] > report.md

Per preset and num_tokens, timed side by side in one process (``tuner.timing.time_op``: median
over CUDA-graph replays of 10 calls, each on its own batch), every config gated against the
float32 reference first:

* ``vllm``: the CUDA rule's pick (vLLM's tuned config for the shape and GPU, else its default);
* ``table``: the shipped table's row for the bucket (``runtime/tables/<SKU>.db``);
* ``grouped <REDUCE>``: moetune_grouped doing the table winner's work per program where it has
  a config per GEMM (``gemm_configs`` into ``MoetuneGroupedKernel.from_gemm_configs``; else
  vLLM's config for both), for each reduce: the same tiles with and without the fusion, so the
  difference is the reduce; and at 2, 4 and 8 tiles of H per GEMM2 program (``g2_N_TILES``);
* each of those again with the weight tiles loaded through TMA descriptors (``W_TMA=1``, keys
  ending ``+tma``), and the table's row itself that way where its winner is moetune_grouped
  (``table+tma``): pointers against TMA at the same tiles.

After ``--budget-s`` seconds the remaining rows are skipped (said so in the report).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from typing import Any

import torch

from moetune.runtime.dispatcher import Dispatcher, shipped_table
from moetune.runtime.kernels.moetune_grouped import N_TILES, REDUCES
from moetune.runtime.platform import detect_sku, environment
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import rule_choice
from moetune.tuner import roofline
from moetune.tuner.gate import relative_error, tolerance
from moetune.tuner.inputs import make_batch, make_weights
from moetune.tuner.presets import preset
from moetune.tuner.timing import time_op

KERNEL = "moetune_grouped"
PRESETS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b", "llama-4-maverick")
GRAPH_CALLS = 10
CEILINGS = roofline.Ceilings(hbm_bytes_per_s=4.28e12, bf16_flops=774e12, fp8_flops=1410e12)


def grouped_params(problem: MoEProblem, winner: str | None,
                   params: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """moetune_grouped doing the winner's work per program (``gemm_configs`` into
    ``from_gemm_configs``; vLLM's config where the winner has no such configs): once per valid
    reduce, and with the seed's reduce at each ``g2_N_TILES`` > 1 (``n2``, ``n4``, ...), keyed
    by those names."""
    kernel = default_registry.get(KERNEL)
    configs = default_registry.get(winner).gemm_configs(problem, params) if winner else None
    base = (kernel.from_gemm_configs(problem, *configs) if configs
            else kernel.seed_params(problem, detect_sku("cuda")))
    if base is None:
        return {}
    base = {**base, "W_TMA": 0}
    variants = {reduce: {**base, "REDUCE": reduce} for reduce in REDUCES}
    variants |= {f"n{n}": {**base, "g2_N_TILES": n} for n in N_TILES[1:]}
    variants |= {f"{k}+tma": {**p, "W_TMA": 1} for k, p in variants.items()}
    if winner == KERNEL:
        variants["table+tma"] = {**kernel.validate(params), "W_TMA": 1}
    return {k: p for k, p in variants.items() if kernel.check_params(problem, p) is None}


def measure(kernel: str, problem: MoEProblem, params: dict[str, Any], weights: Any,
            inputs: list, ref: torch.Tensor) -> dict[str, Any]:
    record: dict[str, Any] = {"kernel": kernel, "params": params}
    try:
        fn = default_registry.get(kernel).prepare(problem, params, weights)
        err = relative_error(fn(*inputs[0]), ref)
        record["error"] = err
        if err > tolerance(problem):
            record["skipped"] = f"relative error {err:.3g} > {tolerance(problem)}"
            return record
        t = time_op(fn, inputs, "cuda", warmup=3, reps=10, graph_calls=GRAPH_CALLS)
        record.update(us=t.median_us, spread=t.spread_us)
    except Exception as e:  # noqa: BLE001 - one config failing is a result
        record["skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--tokens", default="256,1024,4096")
    parser.add_argument("--budget-s", type=float, default=300)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    sku = detect_sku("cuda")
    table = Dispatcher.load(shipped_table(sku), sku)
    log = open(args.json, "w") if args.json else None
    env = environment()
    print(f"# moetune_grouped on {sku.label()} ({datetime.date.today()}, commit {args.commit})\n")
    print(f"torch {env.get('torch')}, triton {env.get('triton')}; `{' '.join(sys.argv)}`\n")
    print("| preset | M | vLLM's pick us | table winner | its us | grouped atomic | "
          "atomic_out | sum | N_TILES 2 | 4 | 8 | best pointers | best TMA | TMA vs pointers | "
          "table+tma | best grouped vs vLLM | vs table | roofline (best) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.presets.split(","):
        shape = preset(name).shape
        weights = make_weights(shape.problem(1), "cuda", seed=0)
        reference = default_registry.get("reference")
        for m in (int(t) for t in args.tokens.split(",")):
            problem = shape.problem(m)
            if time.monotonic() > deadline:
                print(f"| {name} | {m} | skipped: budget spent |" + " |" * 15)
                continue
            inputs = [make_batch(problem, "cuda", seed=1000 * m + i).args()
                      for i in range(GRAPH_CALLS)]
            ref = reference.prepare(problem, {}, weights)(*inputs[0])
            rule = rule_choice(problem, sku)
            chosen = table.select(problem)
            rows = {"vllm": measure(rule.kernel, problem, rule.params, weights, inputs, ref)}
            winner = chosen.params if chosen.source == "table" else None
            if winner is not None:
                rows["table"] = measure(chosen.kernel, problem, winner, weights, inputs, ref)
            for key, params in grouped_params(problem, winner and chosen.kernel, winner).items():
                rows[key] = measure(KERNEL, problem, params, weights, inputs, ref)
            if log:
                log.write(json.dumps({"preset": name, "tokens": m, "rows": rows}) + "\n")
                log.flush()
            print(_row(name, m, problem, chosen.kernel if winner else "-", rows))
            sys.stdout.flush()
            del inputs, ref
            torch.cuda.empty_cache()
        del weights
        torch.cuda.empty_cache()
    return 0


def _row(name: str, m: int, problem: MoEProblem, winner: str, rows: dict[str, Any]) -> str:
    def us(key: str) -> str:
        r = rows.get(key)
        if r is None:
            return "-"
        return f"{r['us']:.1f}" if "us" in r else f"({r['skipped'][:40]})"

    def fastest(keys: list[str]) -> float | None:
        times = [rows[k]["us"] for k in keys if "us" in rows.get(k, {})]
        return min(times) if times else None

    variants = [*REDUCES, *(f"n{n}" for n in N_TILES[1:])]
    pointers, tma = fastest(variants), fastest([f"{k}+tma" for k in variants])
    best = fastest([*variants, *(f"{k}+tma" for k in variants), "table+tma"])
    tma_gain = f"{pointers / tma:.3f}x" if pointers and tma else "-"
    vllm, table = rows["vllm"].get("us"), rows.get("table", {}).get("us")
    vs_vllm = f"{vllm / best:.3f}x" if best and vllm else "-"
    vs_table = f"{table / best:.3f}x" if best and table else "-"
    floor = roofline.floors_us(problem, CEILINGS).roofline_us
    frac = f"{floor / best:.2f}" if best and floor else "-"
    return (f"| {name} | {m} | {us('vllm')} | {winner} | {us('table')} | {us('atomic')} | "
            f"{us('atomic_out')} | {us('sum')} | {us('n2')} | {us('n4')} | {us('n8')} | "
            f"{_us(pointers)} | {_us(tma)} | {tma_gain} | {us('table+tma')} | "
            f"{vs_vllm} | {vs_table} | {frac} |")


def _us(t: float | None) -> str:
    return f"{t:.1f}" if t else "-"


if __name__ == "__main__":
    sys.exit(main())
