"""Variants of one kernel's parameters side by side on one GPU, at the configs the shipped table
serves: what a new parameter is worth before a re-tune searches it.

Usage: VLLM_TUNED_CONFIG_FOLDER=/path/to/vllm/fused_moe/configs \\
       python scripts/bench_param.py --kernel moetune_grouped \\
           --variants "g1_ONE_DOT=0;g1_ONE_DOT=0,W_TMA=0;g1_ONE_DOT=1,W_TMA=0" \\
           [--cases qwen3-30b-a3b:4096,deepseek-v3:1024] [--rounds 3] [--commit SHA] \\
           [--json OUT.jsonl] > report.md

Per case the base config is the table's row where ``--kernel`` serves the bucket, else the
kernel's seed config. Each variant (``;``-separated, each a ``,``-separated list of
``NAME=VALUE``) overrides it; configs the kernel's constraints reject are reported, not run. Every variant is gated against the float32 reference (the
tuner's tolerance), then the variants are timed in ``--rounds`` interleaved rounds (each a
median over CUDA-graph replays of 10 calls, each call on its own batch); a variant's time is
the median of its rounds, and the ratio is against the first variant's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from typing import Any

import torch

from moetune.runtime.dispatcher import Dispatcher, shipped_table
from moetune.runtime.platform import detect_sku, environment
from moetune.runtime.registry import default_registry
from moetune.tuner.gate import relative_error, tolerance
from moetune.tuner.inputs import make_batch, make_weights
from moetune.tuner.presets import preset
from moetune.tuner.timing import time_op

CASES = ("llama-4-maverick:1,llama-4-maverick:4,llama-4-maverick:16,deepseek-v3:1,"
         "deepseek-v3:4,qwen3-30b-a3b:1,qwen3-235b-a22b:1")
GRAPH_CALLS = 10


def parse_variant(text: str) -> dict[str, Any]:
    """``"g1_ONE_DOT=1,W_TMA=0"`` -> {"g1_ONE_DOT": 1, "W_TMA": 0}; values that are not
    integers stay strings."""
    out: dict[str, Any] = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        out[name.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", required=True)
    parser.add_argument("--variants", required=True, help="';'-separated, the baseline first")
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    labels = args.variants.split(";")
    variants = [parse_variant(v) for v in labels]
    sku = detect_sku("cuda")
    table = Dispatcher.load(shipped_table(sku), sku)
    kernel = default_registry.get(args.kernel)
    log = open(args.json, "a") if args.json else None
    env = environment()
    print(f"# {args.kernel}: {' against '.join(labels)} on {sku.label()} "
          f"({datetime.date.today()}, commit {args.commit})\n\ntorch {env.get('torch')}, "
          f"triton {env.get('triton')}; `python {' '.join(sys.argv)}`\n")
    print(f"| case | base | {' | '.join(f'{v} us' for v in labels)} | "
          f"{' | '.join(f'{v} vs {labels[0]}' for v in labels[1:])} |")
    print("|---|---|" + "---|" * (2 * len(labels) - 1))
    ratios: dict[int, list[float]] = {i: [] for i in range(1, len(labels))}
    for case in args.cases.split(","):
        name, tokens = case.split(":")
        problem = preset(name).shape.problem(int(tokens))
        chosen = table.select(problem)
        base, source = ((dict(chosen.params), "table") if chosen.kernel == args.kernel
                        else (kernel.seed_params(problem, sku), "seed"))
        weights = make_weights(problem, "cuda", seed=0)
        inputs = [make_batch(problem, "cuda", seed=1000 * problem.num_tokens + i).args()
                  for i in range(GRAPH_CALLS)]
        ref = default_registry.get("reference").prepare(problem, {}, weights)(*inputs[0])
        fns: dict[int, Any] = {}
        notes: dict[int, str] = {}
        for v, variant in enumerate(variants):
            params = kernel.validate({**base, **variant})
            why = kernel.check_params(problem, params)
            if why:
                notes[v] = why
                continue
            fn = kernel.prepare(problem, params, weights)
            err = relative_error(fn(*inputs[0]), ref)
            if not err <= tolerance(problem):
                notes[v] = f"error {err:.3g} > {tolerance(problem)}"
                continue
            fns[v] = fn
        times: dict[int, list[float]] = {v: [] for v in fns}
        for _ in range(args.rounds):
            for v, fn in fns.items():
                times[v].append(time_op(fn, inputs, "cuda", warmup=3, reps=20,
                                        graph_calls=GRAPH_CALLS).median_us)
        us = {v: statistics.median(t) for v, t in times.items()}
        cells = [f"{us[v]:.1f}" if v in us else f"- ({notes[v]})" for v in range(len(labels))]
        vs = []
        for v in range(1, len(labels)):
            if v in us and 0 in us:
                ratios[v].append(us[0] / us[v])
                vs.append(f"{us[0] / us[v]:.3f}x")
            else:
                vs.append("-")
        print(f"| {case} | {source} | {' | '.join(cells)} | {' | '.join(vs)} |")
        sys.stdout.flush()
        if log:
            log.write(json.dumps({"case": case, "base": base, "source": source, "variants": labels,
                                  "us": us, "rounds": times, "notes": notes}, default=str) + "\n")
            log.flush()
        del weights, inputs, ref, fns
        torch.cuda.empty_cache()
    for v, r in ratios.items():
        if r:
            print(f"\n{labels[v]} against {labels[0]}: geomean "
                  f"{statistics.geometric_mean(r):.3f}x over {len(r)} cases "
                  f"({min(r):.3f}-{max(r):.3f}x; above 1 is faster).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
