"""How far the MoE kernels are from the H200's roofline, per num_tokens bucket.

Usage: python scripts/bench_roofline.py --shape mixtral|deepseek [--buckets 1,64,4096]
           [--commit HASH] [--workers 8] [--skip FAMILY,...] [--json OUT.jsonl] > report.md

Per bucket it prints the HBM floor (the routed experts' weights plus activations in and out at
the measured HBM bandwidth), the compute floor (the GEMM FLOPs at the measured matmul rate of
the layer's GEMM dtype), the CUDA rule's time (aiter_triton with vLLM's default config), each
family's best time over a small sample of configs, and the fraction of the roofline
(max of the two floors) reached. Times: median over CUDA-graph replays timed by events
(tuner.timing), inputs rotated so that consecutive calls route to different experts.
The persistent families relaunch the best aiter_triton tiles as aiter's persistent kernels.
Every timed config is first checked against the float32 reference.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import statistics
import sys
from typing import Any, Iterator

import torch

from moetune.runtime.kernels.base import MoEWeights
from moetune.runtime.kernels.quant import quantize_weights
from moetune.runtime.kernels.triton_config import SPACE, with_prefix
from moetune.runtime.vllm.configs import vllm_default_config
from moetune.runtime.platform import SKU, detect_sku, environment
from moetune.runtime.problem import DEFAULT_BUCKETS, MoEProblem
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import rule_choice
from moetune.tuner import roofline
from moetune.tuner.gate import relative_error, tolerance
from moetune.tuner.roofline import Ceilings, Floors
from moetune.tuner.timing import time_op

SHAPES = {
    "mixtral": MoEProblem(1, 4096, 14336, 8, 2),  # Mixtral-8x7B, bf16, TP1
    "deepseek": MoEProblem(1, 7168, 256, 256, 8, quant="fp8_block_128x128"),  # DeepSeek-V3, TP8
}
# (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages): decode tiles
# (tall K, few rows) to prefill tiles (large M and N, 8 warps), after vLLM's tuned H200 files.
SAMPLE = [(16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3), (16, 64, 256, 1, 4, 3),
          (32, 64, 128, 1, 4, 4), (32, 128, 128, 1, 4, 3), (64, 64, 128, 1, 4, 3),
          (64, 128, 64, 1, 4, 3), (64, 128, 128, 16, 8, 3), (64, 256, 64, 16, 8, 3),
          (128, 128, 64, 16, 8, 3), (128, 128, 128, 16, 8, 3), (128, 256, 64, 16, 8, 4),
          (256, 128, 64, 16, 8, 3)]
E2E_SAMPLE = [(32, 64, 64, 64, 1, 4, 2), (64, 128, 64, 128, 8, 8, 2), (16, 64, 128, 128, 1, 4, 3)]
TOP = 3  # split: combinations of the best TOP fused configs for each GEMM
# Calls per captured graph, each on its own batch: consecutive calls route to other experts, so
# the ~60 MB L2 never holds the next call's weights (the layer's experts are 0.7-3 GB).
GRAPH_CALLS = 10


def configs(problem: MoEProblem) -> list[dict[str, int]]:
    kernel = default_registry.get("aiter_triton")
    out = [dict(zip(SPACE, c)) for c in SAMPLE]
    return [c for c in out if kernel.check_params(problem, c) is None]


def e2e_configs() -> list[dict[str, int]]:
    from moetune.runtime.kernels.aiter_triton_e2e import SPACE as E2E_SPACE

    return [dict(zip(E2E_SPACE, c)) for c in E2E_SAMPLE]


def make_weights_gpu(problem: MoEProblem, seed: int = 0) -> MoEWeights:
    """Random weights made on the GPU (seconds, where tuner.inputs' CPU generator takes minutes)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e, h, i = problem.num_experts, problem.hidden_size, problem.intermediate_size
    w13 = torch.randn(e, 2 * i, h, generator=gen, device="cuda", dtype=torch.bfloat16) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=gen, device="cuda", dtype=torch.bfloat16) / i ** 0.5
    return quantize_weights(w13, w2, problem.quant)


def make_inputs(problem: MoEProblem, count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """``count`` batches with uniform random routing (vLLM's tuner), all different experts."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, e = problem.num_tokens, problem.num_experts
    out = []
    for _ in range(count):
        x = torch.randn(m, problem.hidden_size, generator=gen, device="cuda").bfloat16()
        w, ids = torch.randn(m, e, generator=gen, device="cuda").softmax(-1).topk(problem.topk)
        out.append((x, (w / w.sum(-1, keepdim=True)).contiguous(), ids.int()))
    return out


# --- floors (the arithmetic and the ceilings live in moetune.tuner.roofline) -----------------
def floors_us(problem: MoEProblem, inputs: list[tuple[torch.Tensor, ...]],
              ceilings: Ceilings) -> Floors:
    """The bucket's floors with the experts its timed batches really route to."""
    hit = statistics.mean(len(torch.unique(ids)) for _, _, ids in inputs)
    return roofline.floors_us(problem, ceilings, experts_hit=hit)


# --- candidates --------------------------------------------------------------------------------
def candidates(problem: MoEProblem, sku: SKU,
               best: dict[str, list[tuple[float, dict]]]) -> Iterator[tuple[str, str, dict]]:
    """(family, kernel, params) for one bucket; split and silu_fused reuse aiter_triton's ranking,
    so they come after it."""
    sample = configs(problem)
    choice = rule_choice(problem, sku)
    yield "rule", choice.kernel, choice.params
    for c in sample:
        yield "aiter_triton", "aiter_triton", c
    if best.get("aiter_triton"):
        ranked = [c for _, c in sorted(best["aiter_triton"], key=lambda t: t[0])[:TOP]]
        for g1 in ranked:
            for g2 in ranked:
                if g1 != g2:
                    yield "aiter_triton_split", "aiter_triton_split", {
                        **with_prefix(g1, "g1_"), **with_prefix(g2, "g2_")}
        for g1 in sample:
            yield "aiter_triton_silu_fused", "aiter_triton_silu_fused", {
                **with_prefix(g1, "g1_"), **with_prefix(ranked[0], "g2_")}
        for c in ranked:  # persistent launches of the best tiles
            yield "aiter_triton_persistent", "aiter_triton_persistent", {
                **with_prefix(c, "g1_"), **with_prefix(c, "g2_")}
            yield "aiter_triton_silu_fused_persistent", "aiter_triton_silu_fused_persistent", {
                **with_prefix(c, "g1_"), **with_prefix(ranked[0], "g2_")}
    for c in e2e_configs():
        yield "aiter_triton_e2e", "aiter_triton_e2e", c
    for name in ("torch_grouped", "torch_scaled_grouped"):
        yield name, name, {}


def precompile_work(base: MoEProblem, buckets: list[int], skip: set[str]) -> list[tuple[str, dict]]:
    """Every Triton kernel the bench will run: the fused sample (split reuses its kernels), the
    silu-fused GEMM1 sample, e2e, and the rule's config of each bucket."""
    sample = configs(base)
    work = [("aiter_triton", c) for c in sample]
    work += [("aiter_triton", vllm_default_config(base.with_tokens(m))) for m in buckets]
    if "aiter_triton_silu_fused" not in skip:
        work += [("aiter_triton_silu_fused", {**with_prefix(c, "g1_"), **with_prefix(sample[0], "g2_")})
                 for c in sample]
    if "aiter_triton_e2e" not in skip and not base.quant.is_fp8:
        work += [("aiter_triton_e2e", c) for c in e2e_configs()]
    return work


# --- precompiling in parallel (Triton's on-disk cache is shared between processes) ---------------
_WORKER: dict[str, Any] = {}


def _precompile(shape: str, kernel: str, params: dict, buckets: list[int]) -> str | None:
    try:
        if _WORKER.get("shape") != shape:
            _WORKER.update(shape=shape, weights=make_weights_gpu(SHAPES[shape]))
        for m in buckets:
            problem = SHAPES[shape].with_tokens(m)
            fn = default_registry.get(kernel).prepare(problem, params, _WORKER["weights"])
            fn(*make_inputs(problem, 1, seed=m)[0])
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - reported, and the main process measures again
        return f"{type(e).__name__}: {str(e)[:200]}"


def precompile(shape: str, work: list[tuple[str, dict]], buckets: list[int], workers: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = [pool.submit(_precompile, shape, k, p, buckets) for k, p in work]
        for f, (k, p) in zip(futures, work):
            try:
                err = f.result()
            except Exception as e:  # noqa: BLE001 - a dead worker: the main process re-measures
                err = f"{type(e).__name__}: {e}"
            if err:
                print(f"precompile {k} {p}: {err}", file=sys.stderr)


# --- main --------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--buckets", default=",".join(map(str, DEFAULT_BUCKETS)))
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--workers", type=int, default=8, help="precompiling processes (0: none)")
    parser.add_argument("--skip", default="", help="comma-separated families not to run")
    parser.add_argument("--json", help="also write every measurement here (JSON lines)")
    args = parser.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    base, sku = SHAPES[args.shape], detect_sku("cuda")
    ceilings = roofline.measure_ceilings()

    if args.workers:
        precompile(args.shape, precompile_work(base, buckets, skip), buckets, args.workers)

    weights = make_weights_gpu(base)
    reference = default_registry.get("reference").prepare(base, {}, weights)
    log = open(args.json, "w") if args.json else None
    print(f"# Roofline: {args.shape} ({base.describe().split(' ', 1)[1]})\n")
    print(f"GPU: {sku.label()}; date: {datetime.date.today()}; commit: {args.commit}; "
          f"env: {json.dumps(environment())}\ncommand: python {' '.join(sys.argv)}\n")
    print(f"Measured ceilings: copy {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s, read "
          f"{ceilings.read_bytes_per_s / 1e12:.2f} TB/s (the floor uses the larger), bf16 matmul "
          f"{ceilings.bf16_flops / 1e12:.0f} TFLOP/s, fp8 matmul "
          f"{(ceilings.fp8_flops or float('nan')) / 1e12:.0f} TFLOP/s (8192^3).\n")
    families = ["rule", "aiter_triton", "aiter_triton_split", "aiter_triton_silu_fused",
                "aiter_triton_persistent", "aiter_triton_silu_fused_persistent",
                "aiter_triton_e2e", "torch_grouped", "torch_scaled_grouped"]
    families = [f for f in families if f not in skip]
    print("| tokens | HBM floor us | compute floor us | " + " | ".join(f"{f} us" for f in families)
          + " | best | best / roofline | rule / roofline | best vs rule |")
    print("|" + "---|" * (len(families) + 7))
    for m in buckets:
        problem = base.with_tokens(m)
        inputs = make_inputs(problem, GRAPH_CALLS, seed=m)
        check = inputs[0]
        ref = reference(*check)
        floors = floors_us(problem, inputs, ceilings)
        hbm, compute = floors.hbm_us, floors.compute_us or float("nan")
        best: dict[str, list[tuple[float, dict]]] = {}
        for family, name, params in candidates(problem, sku, best):
            if family in skip:
                continue
            kernel = default_registry.get(name)
            why = kernel.supports(problem, sku)[1] or kernel.check_params(problem, params)
            record = {"shape": args.shape, "tokens": m, "family": family, "kernel": name,
                      "params": params}
            if not why:
                try:
                    fn = kernel.prepare(problem, params, weights)
                    err = relative_error(fn(*check), ref)
                    record["error"] = err
                    if err <= tolerance(problem):
                        t = time_op(fn, inputs, "cuda", warmup=3, reps=10, graph_calls=GRAPH_CALLS)
                        record.update(us=t.median_us, spread=t.spread_us, method=t.method)
                        best.setdefault(family, []).append((t.median_us, params))
                    else:
                        record["skipped"] = "wrong"
                except Exception as e:  # noqa: BLE001 - one config failing is a result
                    record["skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
            else:
                record["skipped"] = why
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
        roof = floors.roofline_us or float("nan")
        times = {f: min(t for t, _ in best[f]) for f in families if best.get(f)}
        top = min(times.values(), default=float("nan"))
        cells = [f"{times[f]:.1f}" if f in times else "-" for f in families]
        rule = times.get("rule", float("nan"))
        print(f"| {m} | {hbm:.1f} | {compute:.1f} | " + " | ".join(cells) +
              f" | {min(times, key=times.get, default='-')} | {roof / top:.0%} | "
              f"{roof / rule:.0%} | {rule / top:.2f}x |", flush=True)
    if log:
        log.close()


if __name__ == "__main__":
    main()
