"""How fast torch's grouped GEMMs (CUTLASS, warp-specialized on sm_90) run the two GEMMs of a
bf16 MoE layer, against the table's whole winner: whether a kernel built on them could beat
the Triton winners where those sit furthest from the roofline (prefill, compute-bound).

Usage: VLLM_TUNED_CONFIG_FOLDER=/path/to/configs python scripts/probe_grouped_mm.py \\
           [--cases mixtral-8x7b:1024,qwen3-30b-a3b:4096] [--commit SHA] > probe.md

Per case: the table's winner (the rule's pick where the GPU has no table) and
``moetune_grouped_mm`` (each the whole layer, CUDA-graph timed
as the tuner does, the latter's error against the float32 reference and the tuner's
tolerance), GEMM1
((pairs, H) x (H, 2I)) and GEMM2 ((pairs, I) x (I, H)) alone through ``torch._grouped_mm``
over the same routing with rows already sorted by expert, their sum, and the sum against the
winner. The glue such a kernel also needs (gathering rows in expert order, the activation, the
weighted top-k sum) is not in the sum: it is bytes, counted in the last columns at the HBM
ceiling given.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

from moetune.runtime.dispatcher import Dispatcher, shipped_table
from moetune.runtime.platform import detect_sku, environment
from moetune.runtime.registry import default_registry
from moetune.tuner.gate import relative_error, tolerance
from moetune.tuner.inputs import make_batch, make_weights
from moetune.tuner.presets import preset
from moetune.tuner.timing import time_op

CASES = ("mixtral-8x7b:512,mixtral-8x7b:1024,mixtral-8x7b:2048,mixtral-8x7b:4096,"
         "qwen3-30b-a3b:1024,qwen3-30b-a3b:2048,qwen3-30b-a3b:3072,qwen3-30b-a3b:4096,"
         "qwen3-235b-a22b:2048,qwen3-235b-a22b:4096")
CALLS = 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--hbm-tbps", type=float, default=4.28)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    dev = args.device
    sku = detect_sku(dev)
    table = Dispatcher.load(shipped_table(sku), sku)
    env = environment()
    print(f"# torch._grouped_mm against the table's winners on {sku.label()} "
          f"({datetime.date.today()}, commit {args.commit})\n\ntorch {env.get('torch')}, "
          f"triton {env.get('triton')}; `python {' '.join(sys.argv)}`\n")
    print("| case | winner | winner us | grouped_mm us | winner / grouped_mm | error (tolerance) "
          "| GEMM1 us | GEMM2 us | GEMMs us | GEMMs / winner | GEMM TFLOP/s | glue MB "
          "| glue us at HBM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        name, tokens = case.split(":")
        problem = preset(name).shape.problem(int(tokens))
        chosen = table.select(problem)
        weights = make_weights(problem, dev, seed=0)
        batches = [make_batch(problem, dev, seed=1000 * problem.num_tokens + i)
                   for i in range(CALLS)]
        kernel = default_registry.get(chosen.kernel)
        fn = kernel.prepare(problem, dict(chosen.params), weights)
        winner = time_op(fn, [b.args() for b in batches], dev).median_us
        ours = default_registry.get("moetune_grouped_mm").prepare(problem, {}, weights)
        ours_us = time_op(ours, [b.args() for b in batches], dev).median_us
        want = default_registry.get("reference").prepare(problem, {}, weights)(*batches[0].args())
        error = relative_error(ours(*batches[0].args()), want)
        del want
        m, topk = batches[0].topk_ids.shape
        hidden, inter = problem.hidden_size, problem.intermediate_size
        w13_t, w2_t = weights.w13.transpose(1, 2), weights.w2.transpose(1, 2)
        g1_inputs, g2_inputs = [], []
        for b in batches:
            flat = b.topk_ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=problem.num_experts)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            rows = b.x[order // topk].contiguous()
            g1_inputs.append((rows, offs))
            g2_inputs.append((torch.randn(m * topk, inter, device=dev,
                                          dtype=b.x.dtype) / inter ** 0.5, offs))
        gemm1 = time_op(lambda a, o: torch._grouped_mm(a, w13_t, offs=o), g1_inputs,
                        dev).median_us
        gemm2 = time_op(lambda a, o: torch._grouped_mm(a, w2_t, offs=o), g2_inputs,
                        dev).median_us
        pairs = m * topk
        flop = 2 * pairs * hidden * inter * (3 if problem.gated else 2)
        # Beyond what the GEMMs read and write: the gather reads x and writes the sorted rows,
        # the activation reads GEMM1's (pairs, 2I) and writes (pairs, I), the weighted sum
        # reads GEMM2's (pairs, H) rows and writes the (m, H) output; bf16 throughout.
        glue = 2 * (2 * m * hidden + 2 * pairs * hidden + 3 * pairs * inter)
        glue_us = glue / (args.hbm_tbps * 1e6)
        both = gemm1 + gemm2
        print(f"| {case} | {chosen.kernel} | {winner:.1f} | {ours_us:.1f} | "
              f"{winner / ours_us:.3f}x | {error:.2g} ({tolerance(problem, dev):.2g}) | "
              f"{gemm1:.1f} | {gemm2:.1f} | "
              f"{both:.1f} | {both / winner:.2f} | {flop / both / 1e6:.0f} | {glue / 1e6:.0f} | "
              f"{glue_us:.1f} |")
        sys.stdout.flush()
        del weights, batches, fn, ours, g1_inputs, g2_inputs
        if dev == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
