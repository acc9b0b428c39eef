"""moetune_grouped's W8A16 (``DEQUANT=1``: fp8 weight tiles dequantized in the kernel, bf16
tensor cores, no activation quantization) against its W8A8 (``DEQUANT=0``), the shipped table's
winner and vLLM's pick, at fp8 presets' buckets, on one GPU.

Usage: VLLM_TUNED_CONFIG_FOLDER=/path/to/vllm/fused_moe/configs \\
       python scripts/bench_dequant.py [--presets deepseek-v3,llama-4-maverick]
           [--tokens 8,512,4096] [--commit SHA] [--json OUT.jsonl] > report.md

Per preset and num_tokens, side by side in one process (``bench_grouped.measure``: gated
against the float32 reference, then the median over CUDA-graph replays of 10 calls, each on its
own batch):

* ``vllm``: the CUDA rule's pick (vLLM's tuned config for the shape and GPU, else its default);
* ``table``: the shipped table's row for the bucket;
* ``w8a8`` / ``w8a16``: moetune_grouped at the table winner's tiles (``gemm_configs`` into
  ``from_gemm_configs``; vLLM's fp8 config where the winner has none), W_TMA as the winner's
  where it is moetune_grouped, with ``DEQUANT`` 0 and 1;
* ``w8a16 bf16-tiles``: W8A16 at the tiles vLLM runs for the same shape in bf16, whose GEMMs
  the dequantized kernel now is.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from typing import Any

import torch

from bench_grouped import CEILINGS, GRAPH_CALLS, KERNEL, measure
from moetune.runtime.dispatcher import Dispatcher, shipped_table
from moetune.runtime.platform import SKU, detect_sku, environment
from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import rule_choice
from moetune.runtime.vllm.configs import vllm_config
from moetune.tuner import roofline
from moetune.tuner.inputs import make_batch, make_weights
from moetune.tuner.presets import preset

COLUMNS = ("vllm", "table", "w8a8", "w8a16", "w8a16 bf16-tiles")


def variants(problem: MoEProblem, sku: SKU, winner: str | None,
             params: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """moetune_grouped's W8A8 and W8A16 points at the winner's tiles and at vLLM's bf16 tiles,
    keyed by COLUMNS' names; those that cannot run here are left out."""
    kernel = default_registry.get(KERNEL)
    configs = default_registry.get(winner).gemm_configs(problem, params) if winner else None
    base = kernel.from_gemm_configs(problem, *configs) if configs else kernel.seed_params(
        problem, sku)
    if winner == KERNEL:
        base = kernel.validate(params)
    bf16 = dataclasses.replace(problem, quant=QuantScheme.NONE)
    config = vllm_config(bf16, sku)[0]
    out = {"w8a8": {**base, "DEQUANT": 0}, "w8a16": {**base, "DEQUANT": 1},
           "w8a16 bf16-tiles": {**kernel.from_gemm_configs(bf16, config, config), "DEQUANT": 1}}
    return {k: p for k, p in out.items() if kernel.check_params(problem, p) is None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="deepseek-v3,llama-4-maverick")
    parser.add_argument("--tokens", default="8,64,512,1024,2048,4096")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sku = detect_sku("cuda")
    table = Dispatcher.load(shipped_table(sku), sku)
    log = open(args.json, "w") if args.json else None
    env = environment()
    print(f"# moetune_grouped W8A16 vs W8A8 on {sku.label()} ({datetime.date.today()}, commit "
          f"{args.commit})\n\ntorch {env.get('torch')}, triton {env.get('triton')}; "
          f"`python {' '.join(sys.argv)}`\n")
    print("| preset | M | table winner | " + " | ".join(f"{c} us" for c in COLUMNS)
          + " | best w8a16 vs vLLM | vs table | vs w8a8 | roofline (best w8a16) |")
    print("|---" * (len(COLUMNS) + 7) + "|")
    for name in args.presets.split(","):
        shape = preset(name).shape
        weights = make_weights(shape.problem(1), "cuda", seed=0)
        reference = default_registry.get("reference")
        for m in (int(t) for t in args.tokens.split(",")):
            problem = shape.problem(m)
            inputs = [make_batch(problem, "cuda", seed=1000 * m + i).args()
                      for i in range(GRAPH_CALLS)]
            ref = reference.prepare(problem, {}, weights)(*inputs[0])
            rule, chosen = rule_choice(problem, sku), table.select(problem)
            rows = {"vllm": measure(rule.kernel, problem, rule.params, weights, inputs, ref)}
            winner = chosen.params if chosen.source == "table" else None
            if winner is not None:
                rows["table"] = measure(chosen.kernel, problem, winner, weights, inputs, ref)
            for key, params in variants(problem, sku, winner and chosen.kernel, winner).items():
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
    def us(key: str) -> float | None:
        return rows.get(key, {}).get("us")

    def cell(key: str) -> str:
        if key not in rows:
            return "-"
        return f"{us(key):.1f}" if us(key) else f"({rows[key]['skipped'][:40]})"

    dequant = [t for t in (us("w8a16"), us("w8a16 bf16-tiles")) if t]
    best = min(dequant) if dequant else None

    def ratio(key: str) -> str:
        return f"{us(key) / best:.3f}x" if best and us(key) else "-"

    floor = roofline.floors_us(problem, CEILINGS).roofline_us
    frac = f"{floor / best:.2f}" if best and floor else "-"
    return (f"| {name} | {m} | {winner} | " + " | ".join(cell(c) for c in COLUMNS)
            + f" | {ratio('vllm')} | {ratio('table')} | {ratio('w8a8')} | {frac} |")


if __name__ == "__main__":
    sys.exit(main())
