"""Where one MoE call's time goes, launch by launch: the table's winner and vLLM's pick at a few
(preset, num_tokens) cases, under torch's profiler on one GPU.

Usage: VLLM_TUNED_CONFIG_FOLDER=/path/to/vllm/fused_moe/configs \\
       python scripts/profile_moe.py [--cases deepseek-v3:4096,qwen3-235b-a22b:4096]
           [--table TABLE] [--commit SHA] > profile.md

Per case and kernel it prints each launch's device time per MoE call (the mean over 10 calls,
each on its own batch after 3 warm-up calls, no CUDA graph: the profiler sees every launch),
its share of the call, and the layer's GEMM FLOPs and expert bytes against that time.
``--table``: the tuned table to take winners from (default: the shipped one for the GPU).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from moetune.runtime.dispatcher import Dispatcher, shipped_table
from moetune.runtime.platform import detect_sku, environment
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import rule_choice
from moetune.tuner import roofline
from moetune.tuner.inputs import make_batch, make_weights
from moetune.tuner.presets import preset

CASES = "deepseek-v3:4096,qwen3-235b-a22b:4096,qwen3-30b-a3b:4096,mixtral-8x7b:1024"
CALLS, WARMUP = 10, 3


def launches(fn, inputs: list[tuple[torch.Tensor, ...]]) -> dict[str, tuple[int, float]]:
    """Kernel name -> (launches per call, device microseconds per call)."""
    for args in inputs[:WARMUP]:
        fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for args in inputs:
            fn(*args)
        torch.cuda.synchronize()
    count: dict[str, int] = collections.Counter()
    total: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count[event.name] += 1
            total[event.name] += event.device_time_total
    return {name: (count[name] // len(inputs), total[name] / len(inputs)) for name in total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--table")
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    sku = detect_sku("cuda")
    table = Dispatcher.load(args.table or shipped_table(sku), sku)
    env = environment()
    print(f"# Launches per MoE call on {sku.label()} ({datetime.date.today()}, commit "
          f"{args.commit})\n\ntorch {env.get('torch')}, triton {env.get('triton')}; "
          f"`python {' '.join(sys.argv)}`\n")
    ceilings = roofline.measure_ceilings()
    print(f"Ceilings measured first: {ceilings.describe()}.\n")
    for case in args.cases.split(","):
        name, tokens = case.split(":")
        problem = preset(name).shape.problem(int(tokens))
        weights = make_weights(problem, "cuda", seed=0)
        inputs = [make_batch(problem, "cuda", seed=i).args() for i in range(CALLS)]
        h, i = problem.hidden_size, problem.intermediate_size
        pairs = problem.num_tokens * problem.topk
        gemm1 = 2 * pairs * (2 if problem.gated else 1) * i * h
        gemm2 = 2 * pairs * h * i
        floors = roofline.floors_us(problem, ceilings)
        print(f"## {name} at {tokens} tokens ({problem.describe()})\n")
        print(f"GEMM1 {gemm1 / 1e9:.1f} GFLOP, GEMM2 {gemm2 / 1e9:.1f} GFLOP; floors: HBM "
              f"{floors.hbm_us:.1f} us, compute {floors.compute_us or float('nan'):.1f} us.\n")
        chosen = table.select(problem)
        rule = rule_choice(problem, sku)
        for label, kernel, params in ((f"served ({chosen.source})", chosen.kernel, chosen.params),
                                      ("vLLM's pick", rule.kernel, rule.params)):
            fn = default_registry.get(kernel).prepare(problem, params, weights)
            rows = sorted(launches(fn, inputs).items(), key=lambda kv: -kv[1][1])
            total = sum(us for _, (_, us) in rows)
            print(f"### {label}: {kernel} `{params}`\n\n{total:.1f} us of launches per call "
                  f"({gemm1 + gemm2:.3g} FLOP: {(gemm1 + gemm2) / total / 1e6:.0f} TFLOP/s)\n")
            print("| launch | per call | us per call | share |\n|---|---|---|---|")
            for launch, (n, us) in rows:
                print(f"| `{launch[:90]}` | {n} | {us:.1f} | {us / total:.0%} |")
            print()
            sys.stdout.flush()
        del weights, inputs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
