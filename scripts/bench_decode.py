"""moetune_decode and moetune_decode_one against vLLM's pick at decode sizes, and all against the
HBM floor (one H200).

Usage: VLLM_TUNED_CONFIG_FOLDER=/path/to/vllm/fused_moe/configs \\
       python scripts/bench_decode.py [--shapes llama4,deepseek,qwen3] [--tokens 1,2,4,8,16]
           [--workers 8] [--budget-s 330] [--measure-ceilings] [--json OUT.jsonl] > report.md

For each shape and num_tokens it times the CUDA rule's pick (``rules.rule_choice``: aiter_triton
with vLLM's tuned config where VLLM_TUNED_CONFIG_FOLDER or the installed vLLM has one, else its
default) and the best moetune_decode config of a small two-stage sweep: GEMM1 tiles with the
seed's GEMM2, then GEMM2 tiles, split-K and reduces with the best GEMM1. Every config is gated
against the float32 reference first (the tuner's tolerance). Times: ``tuner.timing.time_op``
(median over CUDA-graph replays of 10 calls, each on its own batch so that consecutive calls
read other experts). The HBM floor is ``tuner.roofline``'s: the routed experts' weights plus the
activations at 4.28 TB/s (``--measure-ceilings``: the measured bandwidth instead).

Every kernel is compiled ahead in ``--workers`` processes (Triton's on-disk cache is shared);
moetune_decode compiles once per shape (num_tokens only sizes its grid). After ``--budget-s``
seconds the remaining buckets time the seed config only, so the run stays within 6 minutes.
Rows are printed as they are measured.

moetune_decode_one (the one-launch persistent kernel, up to 8 tokens of top-8) is timed the same
way over ``ONE_SAMPLE``: its seed with other grid sizes, warps and tiles (compiled on first use,
not ahead); its columns say how it compares with the rule and with moetune_decode's best here.
``--tokens 1,2,4,8`` is the range it is offered at.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import statistics
import sys
import time
from typing import Any

import torch

from moetune.runtime.kernels.base import params_key
from moetune.runtime.platform import detect_sku, environment
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import rule_choice
from moetune.tuner import roofline
from moetune.tuner.gate import relative_error, tolerance
from moetune.tuner.inputs import make_batch, make_weights
from moetune.tuner.timing import time_op

SHAPES = {
    # Llama-4-Maverick TP8: top-1, router weight on the input, fp8 per-channel.
    "llama4": MoEProblem(1, 5120, 1024, 128, 1, quant="fp8_per_channel",
                         router_weight_on_input=True),
    "deepseek": MoEProblem(1, 7168, 256, 256, 8, quant="fp8_block_128x128"),  # DeepSeek-V3 TP8
    "qwen3": MoEProblem(1, 2048, 768, 128, 8),  # Qwen3-30B-A3B, bf16
}
KERNEL = "moetune_decode"
# GEMM1 (BLOCK_N, BLOCK_K, num_warps, num_stages): 4-32 rows of gate and up, long K (a GEMV
# keeps HBM busy by having many bytes in flight per program).
G1_SAMPLE = [(4, 512, 4, 2), (4, 1024, 4, 2), (4, 256, 2, 2), (4, 512, 2, 3), (8, 512, 4, 2),
             (8, 1024, 8, 2), (8, 256, 4, 3), (8, 512, 8, 3), (8, 128, 2, 3), (16, 256, 4, 2),
             (16, 512, 8, 2), (16, 128, 4, 3), (32, 256, 8, 2), (32, 128, 4, 2)]
# GEMM2 (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K, REDUCE).
G2_SAMPLE = [(16, 256, 4, 2, 1, "atomic"), (16, 512, 4, 2, 1, "atomic"),
             (32, 128, 4, 2, 1, "atomic"),
             (32, 256, 8, 2, 1, "atomic"), (64, 128, 4, 2, 1, "atomic"),
             (64, 64, 4, 3, 1, "atomic"), (128, 64, 8, 2, 1, "atomic"),
             (16, 128, 2, 2, 1, "atomic"), (32, 128, 4, 2, 2, "atomic"),
             (64, 128, 8, 2, 2, "atomic"), (16, 256, 4, 3, 4, "atomic"),
             (32, 128, 4, 2, 1, "atomic_out"), (64, 128, 4, 2, 1, "atomic_out"),
             (32, 128, 4, 2, 1, "ordered"), (64, 128, 4, 2, 2, "ordered")]
#: moetune_decode_one variants of its seed: PROGRAMS_PER_SM, num_warps, num_stages, and
#: (BLOCK_N1, BLOCK_K1, BLOCK_N2, BLOCK_K2) or None for the seed's tiles.
ONE = "moetune_decode_one"
ONE_SAMPLE = [(2, 4, 2, None), (1, 4, 2, None), (3, 4, 2, None), (4, 4, 2, None),
              (2, 8, 2, None), (2, 4, 3, None), (1, 8, 3, None), (2, 4, 2, (4, 512, 32, 128)),
              (2, 4, 2, (8, 256, 16, 256)), (2, 4, 2, (2, 1024, 8, 256)),
              (4, 2, 2, (4, 256, 16, 128)), (2, 8, 2, (16, 512, 64, 128))]
GRAPH_CALLS = 10  # calls per captured graph, each on its own batch (other experts each call)
DEFAULT_CEILINGS = roofline.Ceilings(hbm_bytes_per_s=4.28e12, bf16_flops=774e12,
                                     fp8_flops=1410e12)


def g1_params(c: tuple) -> dict[str, Any]:
    return dict(zip(("g1_BLOCK_N", "g1_BLOCK_K", "g1_num_warps", "g1_num_stages"), c))


def g2_params(c: tuple) -> dict[str, Any]:
    return dict(zip(("g2_BLOCK_N", "g2_BLOCK_K", "g2_num_warps", "g2_num_stages", "SPLIT_K",
                     "REDUCE"), c))


def _valid(problem: MoEProblem, params: dict[str, Any]) -> bool:
    return default_registry.get(KERNEL).check_params(problem, params) is None


def stage_one(problem: MoEProblem, seed: dict[str, Any]) -> list[dict[str, Any]]:
    """GEMM1 tiles with the seed's GEMM2."""
    out = [seed] + [{**seed, **g1_params(c)} for c in G1_SAMPLE]
    return _unique([p for p in out if _valid(problem, p)])


def stage_two(problem: MoEProblem, best: dict[str, Any]) -> list[dict[str, Any]]:
    """GEMM2 tiles, split-K and reduces with the best GEMM1."""
    out = [{**best, **g2_params(c)} for c in G2_SAMPLE]
    return _unique([p for p in out if _valid(problem, p)])


def one_configs(problem: MoEProblem, seed: dict[str, Any]) -> list[dict[str, Any]]:
    """``ONE_SAMPLE`` around moetune_decode_one's seed, those its constraints keep."""
    kernel, out = default_registry.get(ONE), []
    for per_sm, warps, stages, tiles in ONE_SAMPLE:
        params = dict(seed, PROGRAMS_PER_SM=per_sm, num_warps=warps, num_stages=stages)
        if tiles:
            params.update(zip(("BLOCK_N1", "BLOCK_K1", "BLOCK_N2", "BLOCK_K2"), tiles))
        if kernel.check_params(problem, params) is None:
            out.append(params)
    return _unique(out)


def _unique(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for c in configs:
        seen.setdefault(params_key(c), c)
    return list(seen.values())


def inputs_for(problem: MoEProblem) -> list[tuple[torch.Tensor, ...]]:
    return [make_batch(problem, "cuda", seed=1000 * problem.num_tokens + i).args()
            for i in range(GRAPH_CALLS)]


# --- compiling ahead in parallel (Triton's on-disk cache is shared between processes) ----------
_WORKER: dict[str, Any] = {}


def _compile(shape: str, kernel: str, params: dict, tokens: list[int]) -> str | None:
    try:
        if _WORKER.get("shape") != shape:
            _WORKER.clear()
            torch.cuda.empty_cache()
            _WORKER.update(shape=shape, weights=make_weights(SHAPES[shape], "cuda", seed=0))
        for m in tokens:
            problem = SHAPES[shape].with_tokens(m)
            fn = default_registry.get(kernel).prepare(problem, params, _WORKER["weights"])
            fn(*make_batch(problem, "cuda", seed=m).args())
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - reported; the main process measures again
        return f"{type(e).__name__}: {str(e)[:200]}"


def compile_work(shape: str, tokens: list[int]) -> list[tuple[str, str, dict, list[int]]]:
    """Every kernel the sweep can run for ``shape``: each GEMM1 tile with the GEMM2 modes that
    change its launch (zeroing or not), each GEMM2 variant, and the rule's config per bucket."""
    base, sku = SHAPES[shape], detect_sku("cuda")
    kernel = default_registry.get(KERNEL)
    work: list[tuple[str, str, dict, list[int]]] = []
    decode: list[dict[str, Any]] = []
    for m in tokens:
        seed = kernel.seed_params(base.with_tokens(m), sku)
        seconds = stage_two(base, seed)
        # GEMM1 compiles twice: zeroing GEMM2's accumulator (atomic reduces) or not.
        kinds = {_zeroes(base, p): p for p in reversed(seconds)}
        for first in stage_one(base, seed):
            g1 = {k: v for k, v in first.items() if k.startswith("g1_")}
            decode += [first] + [{**second, **g1} for second in kinds.values()]
        decode += seconds
    work += [(shape, KERNEL, p, [1]) for p in _unique([p for p in decode if _valid(base, p)])]
    for m in tokens:
        choice = rule_choice(base.with_tokens(m), sku)
        work.append((shape, choice.kernel, choice.params, [m]))
    return work


def _zeroes(problem: MoEProblem, params: dict[str, Any]) -> bool:
    """Whether GEMM1 zeroes an accumulator for GEMM2's atomics under ``params``."""
    direct = problem.topk == 1 and params["SPLIT_K"] == 1
    return not direct and params["REDUCE"] != "ordered"


def compile_ahead(work: list[tuple[str, str, dict, list[int]]], workers: int,
                  timeout_s: float) -> int:
    """Run ``work`` in ``workers`` processes for at most ``timeout_s``; how many jobs ran (what
    is left compiles on first use in the main process)."""
    ctx = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx)
    futures = [pool.submit(_compile, *job) for job in work]
    done, _ = concurrent.futures.wait(futures, timeout=timeout_s)
    pool.shutdown(wait=True, cancel_futures=True)  # the running jobs finish, the rest never start
    for future, job in zip(futures, work):
        if future not in done:
            continue
        try:
            err = future.result()
        except Exception as e:  # noqa: BLE001 - a dead worker: the main process compiles
            err = f"{type(e).__name__}: {e}"
        if err:
            print(f"compile ahead {job[0]} {job[1]} {job[2]}: {err}", file=sys.stderr)
    return len(done)


# --- measuring -----------------------------------------------------------------------------------
def measure(kernel: str, problem: MoEProblem, params: dict, weights: Any,
            inputs: list, ref: torch.Tensor, log: Any, shape: str) -> float | None:
    """Gate then time one config; None if it fails or is wrong (logged either way)."""
    record: dict[str, Any] = {"shape": shape, "tokens": problem.num_tokens, "kernel": kernel,
                              "params": params}
    try:
        fn = default_registry.get(kernel).prepare(problem, params, weights)
        err = relative_error(fn(*inputs[0]), ref)
        record["error"] = err
        if err <= tolerance(problem):
            t = time_op(fn, inputs, "cuda", warmup=3, reps=10, graph_calls=GRAPH_CALLS)
            record.update(us=t.median_us, spread=t.spread_us, method=t.method)
        else:
            record["skipped"] = f"relative error {err:.3g} > {tolerance(problem)}"
    except Exception as e:  # noqa: BLE001 - one config failing is a result
        record["skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
    if log:
        log.write(json.dumps(record) + "\n")
        log.flush()
    if "skipped" in record:
        print(f"{shape} M={problem.num_tokens} {kernel} {params}: {record['skipped']}",
              file=sys.stderr)
    return record.get("us")


def short(params: dict[str, Any]) -> str:
    """``g1 8x512 w4 s2 / g2 32x128 w4 s2 split1 atomic``."""
    p = params
    return (f"g1 {p['g1_BLOCK_N']}x{p['g1_BLOCK_K']} w{p['g1_num_warps']} s{p['g1_num_stages']}"
            f" / g2 {p['g2_BLOCK_N']}x{p['g2_BLOCK_K']} w{p['g2_num_warps']} "
            f"s{p['g2_num_stages']} split{p['SPLIT_K']} {p['REDUCE']}")


def bucket_row(shape: str, problem: MoEProblem, weights: Any, reference: Any,
               ceilings: roofline.Ceilings, deadline: float, log: Any) -> str:
    """Time the rule's pick and the sweep for one bucket; its Markdown row."""
    sku, kernel, m = detect_sku("cuda"), default_registry.get(KERNEL), problem.num_tokens
    inputs = inputs_for(problem)
    ref = reference(*inputs[0])
    hit = statistics.mean(len(torch.unique(ids)) for _, _, ids in inputs)
    floor = roofline.floors_us(problem, ceilings, experts_hit=hit).hbm_us
    choice = rule_choice(problem, sku)
    rule = measure(choice.kernel, problem, choice.params, weights, inputs, ref, log, shape)
    rule = float("nan") if rule is None else rule
    ok, why = kernel.supports(problem, sku)
    seed = kernel.seed_params(problem, sku) if ok else None
    timed: dict[str, tuple[float, dict]] = {}

    def run(configs: list[dict[str, Any]]) -> None:
        for params in configs:
            key = params_key(params)
            if key in timed:
                continue
            if timed and time.perf_counter() > deadline:  # out of time: the seed alone
                return
            us = measure(KERNEL, problem, params, weights, inputs, ref, log, shape)
            if us is not None:
                timed[key] = (us, params)

    if seed is not None:
        run([seed])
        run(stage_one(problem, seed))
        run(stage_two(problem, min(timed.values(), key=lambda t: t[0])[1] if timed else seed))
    lead = f"| {shape} | {m} | {floor:.1f} | {rule:.1f} |"
    one = one_cells(problem, weights, inputs, ref, log, shape, deadline,
                    min(timed.values(), key=lambda t: t[0])[0] if timed else float("nan"), rule)
    if not timed:
        why = why or "every config failed (see stderr)"
        return f"{lead} - | - | - | {floor / rule:.2f} | 0 | {why} | {one} {choice.reason} |"
    us, params = min(timed.values(), key=lambda t: t[0])
    return (f"{lead} {us:.1f} | {rule / us:.2f}x | {floor / us:.2f} | {floor / rule:.2f} | "
            f"{len(timed)} | {short(params)} | {one} {choice.reason} |")


def one_cells(problem: MoEProblem, weights: Any, inputs: list, ref: torch.Tensor, log: Any,
              shape: str, deadline: float, decode_us: float, rule_us: float) -> str:
    """moetune_decode_one's cells: best us, speedup over the rule and over moetune_decode's
    best, configs timed, the best config (after ``deadline``: the seed alone)."""
    kernel, sku = default_registry.get(ONE), detect_sku("cuda")
    ok, why = kernel.supports(problem, sku)
    seed = kernel.seed_params(problem, sku) if ok else None
    if seed is None:
        return f"- | - | - | 0 | {why or 'no seed'} |"
    timed: list[tuple[float, dict[str, Any]]] = []
    for params in one_configs(problem, seed):
        if timed and time.perf_counter() > deadline:
            break
        us = measure(ONE, problem, params, weights, inputs, ref, log, shape)
        if us is not None:
            timed.append((us, params))
    if not timed:
        return "- | - | - | 0 | every config failed (see stderr) |"
    us, params = min(timed, key=lambda t: t[0])
    config = (f"{params['BLOCK_N1']}x{params['BLOCK_K1']} / {params['BLOCK_N2']}x"
              f"{params['BLOCK_K2']} w{params['num_warps']} s{params['num_stages']} "
              f"{params['PROGRAMS_PER_SM']}/SM")
    return (f"{us:.1f} | {rule_us / us:.2f}x | {decode_us / us:.2f}x | {len(timed)} | "
            f"{config} |")


def main() -> None:
    start = time.perf_counter()
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--workers", type=int, default=8, help="compiling processes (0: none)")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="after this many seconds, time only the seed config")
    parser.add_argument("--measure-ceilings", action="store_true",
                        help="measure HBM bandwidth here instead of assuming 4.28 TB/s")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--json", help="also write every measurement here (JSON lines)")
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    tokens = [int(t) for t in args.tokens.split(",")]
    sku = detect_sku("cuda")
    ceilings = roofline.measure_ceilings() if args.measure_ceilings else DEFAULT_CEILINGS

    print(f"# moetune_decode vs vLLM's pick at decode sizes\n\nGPU: {sku.label()}; date: "
          f"{datetime.date.today()}; commit: {args.commit}; env: {json.dumps(environment())}\n"
          f"command: python {' '.join(sys.argv)}\nceilings: {ceilings.describe()}\n", flush=True)
    if args.workers:
        work = [job for shape in shapes for job in compile_work(shape, tokens)]
        ran = compile_ahead(work, args.workers, timeout_s=0.4 * args.budget_s)
        print(f"compiled {ran} of {len(work)} configs ahead in "
              f"{time.perf_counter() - start:.0f} s\n", flush=True)

    print("| shape | tokens | HBM floor us | rule us | decode us | speedup | decode / floor | "
          "rule / floor | configs | best config | one us | one vs rule | one vs decode | "
          "one configs | one config | rule |")
    print("|" + "---|" * 16, flush=True)
    log = open(args.json, "w") if args.json else None
    for shape in shapes:
        torch.cuda.empty_cache()
        weights = make_weights(SHAPES[shape], "cuda", seed=0)
        reference = default_registry.get("reference").prepare(SHAPES[shape], {}, weights)
        for m in tokens:
            deadline = start + args.budget_s
            print(bucket_row(shape, SHAPES[shape].with_tokens(m), weights, reference, ceilings,
                             deadline, log), flush=True)
        del weights, reference
    if log:
        log.close()
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
