"""What fewer launches per MoE call save on one GPU: the align's two paths side by side, and the
shipped table's rows timed as the installed moetune serves them.

Usage: VLLM_TUNED_CONFIG_FOLDER=/path/to/vllm/fused_moe/configs \\
       python scripts/bench_launches.py align [--json OUT.jsonl] > align.md
       python scripts/bench_launches.py layers --label NAME [--cases deepseek-v3:8,...] --json L.jsonl
       python scripts/bench_launches.py compare BEFORE.jsonl AFTER.jsonl [--commit SHA] > layers.md

``align``: ``_align.align`` in one launch and in three (plus two fills), at each size of
``--tokens`` x top-8 pairs and (experts, BLOCK_SIZE_M) of the presets, timed side by side
(median over CUDA-graph replays of 10 calls, each on its own routing).

``layers``: each case's table row (``Dispatcher.select`` on the shipped table, or vLLM's pick
where the table has none) timed as served by whichever moetune this Python imports, gated
against the float32 reference. Run it alternately under two checkouts' packages in one
session (``PYTHONPATH=base/ python ...``) and ``compare`` the files: per case the median over
each label's runs, and the ratio.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics
import sys
from typing import Any

import torch

GRAPH_CALLS = 10
CASES = ("deepseek-v3:8,deepseek-v3:64,deepseek-v3:512,deepseek-v3:4096,qwen3-30b-a3b:2,"
         "qwen3-30b-a3b:256,llama-4-maverick:24,llama-4-maverick:1024,qwen3-235b-a22b:256,"
         "qwen3-235b-a22b:4096")
#: (experts, BLOCK_SIZE_M) the presets' table rows align with.
ALIGN_SHAPES = ((256, 64), (256, 16), (128, 16), (128, 64))


def _timing(fn: Any, inputs: list) -> float:
    from moetune.tuner.timing import time_op

    return time_op(fn, inputs, "cuda", warmup=3, reps=20, graph_calls=GRAPH_CALLS).median_us


def bench_align(tokens: list[int], log: Any) -> None:
    from moetune.runtime.kernels._align import ONE_PROGRAM_MAX, align

    print(f"# align: one launch against three (+2 fills), {datetime.date.today()}\n")
    print(f"served: one launch up to {ONE_PROGRAM_MAX} routed pairs\n")
    print("| experts | BLOCK_SIZE_M | tokens x 8 | pairs | one launch us | three launches us |"
          " one vs three |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for (experts, block), m in ((s, m) for s in ALIGN_SHAPES for m in tokens):
        inputs = [(torch.rand(m, experts, device="cuda", generator=gen).topk(8).indices.int(),)
                  for _ in range(GRAPH_CALLS)]
        times = {}
        for path, limit in (("one", 1 << 30), ("three", 0)):
            def run(ids: torch.Tensor, limit: int = limit) -> torch.Tensor:
                return align(ids, block, experts, one_program_max=limit).sorted_token_ids
            times[path] = _timing(run, inputs)
        record = {"experts": experts, "block_m": block, "tokens": m, "pairs": 8 * m, **times}
        if log:
            log.write(json.dumps(record) + "\n")
        print(f"| {experts} | {block} | {m} | {8 * m} | {times['one']:.1f} | "
              f"{times['three']:.1f} | {times['three'] / times['one']:.2f}x |")
        sys.stdout.flush()


def bench_layers(cases: list[tuple[str, int]], label: str, log: Any) -> None:
    import moetune
    from moetune.runtime.dispatcher import Dispatcher, shipped_table
    from moetune.runtime.platform import detect_sku
    from moetune.runtime.registry import default_registry
    from moetune.runtime.rules import rule_choice
    from moetune.tuner.gate import relative_error, tolerance
    from moetune.tuner.inputs import make_batch, make_weights
    from moetune.tuner.presets import preset

    sku = detect_sku("cuda")
    table = Dispatcher.load(shipped_table(sku), sku)
    print(f"{label}: moetune from {moetune.__file__}", file=sys.stderr)
    by_preset: dict[str, list[int]] = collections.defaultdict(list)
    for name, m in cases:
        by_preset[name].append(m)
    for name, tokens in by_preset.items():
        shape = preset(name).shape
        weights = make_weights(shape.problem(1), "cuda", seed=0)
        for m in tokens:
            problem = shape.problem(m)
            inputs = [make_batch(problem, "cuda", seed=1000 * m + i).args()
                      for i in range(GRAPH_CALLS)]
            ref = default_registry.get("reference").prepare(problem, {}, weights)(*inputs[0])
            chosen = table.select(problem)
            kernel, params = ((chosen.kernel, chosen.params) if chosen.source == "table"
                              else (rule_choice(problem, sku).kernel,
                                    rule_choice(problem, sku).params))
            fn = default_registry.get(kernel).prepare(problem, params, weights)
            error = relative_error(fn(*inputs[0]), ref)
            record = {"label": label, "preset": name, "tokens": m, "kernel": kernel,
                      "params": params, "error": error}
            if error <= tolerance(problem):
                record["us"] = _timing(fn, inputs)
            log.write(json.dumps(record, default=str) + "\n")
            log.flush()
            print(f"{label} {name}:{m} {kernel} {record.get('us', 'FAILED GATE')}",
                  file=sys.stderr)
            del inputs, ref, fn
            torch.cuda.empty_cache()
        del weights
        torch.cuda.empty_cache()


def compare(before: str, after: str, commit: str) -> None:
    def load(path: str) -> tuple[str, dict[tuple[str, int], dict[str, Any]]]:
        runs: dict[tuple[str, int], dict[str, Any]] = {}
        label = "?"
        for line in open(path):
            r = json.loads(line)
            label = r["label"]
            row = runs.setdefault((r["preset"], r["tokens"]), {"kernel": r["kernel"], "us": []})
            if "us" in r:
                row["us"].append(r["us"])
        return label, runs

    (label_a, a), (label_b, b) = load(before), load(after)
    print(f"# The shipped table's rows before and after ({datetime.date.today()}, "
          f"commit {commit})\n")
    print(f"Median of each label's runs (each a median over CUDA-graph replays of "
          f"{GRAPH_CALLS} calls), the runs of both labels alternating in one session.\n")
    print(f"| preset | tokens | kernel | {label_a} us | {label_b} us | {label_b} vs {label_a} |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for key in a:
        if key not in b or not a[key]["us"] or not b[key]["us"]:
            continue
        ta, tb = statistics.median(a[key]["us"]), statistics.median(b[key]["us"])
        ratios.append(ta / tb)
        print(f"| {key[0]} | {key[1]} | {a[key]['kernel']} | {ta:.1f} | {tb:.1f} | "
              f"{ta / tb:.3f}x |")
    if ratios:
        print(f"\nGeomean {statistics.geometric_mean(ratios):.3f}x over {len(ratios)} cases "
              f"({min(ratios):.3f}-{max(ratios):.3f}x).")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("align", "layers", "compare"))
    parser.add_argument("files", nargs="*")
    parser.add_argument("--tokens", default="1,8,64,128,256,512,1024,2048,4096")
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--label", default="this")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    log = open(args.json, "a") if args.json else None
    if args.mode == "align":
        bench_align([int(t) for t in args.tokens.split(",")], log)
    elif args.mode == "layers":
        if log is None:
            parser.error("layers needs --json")
        cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
        bench_layers(cases, args.label, log)
    else:
        compare(*args.files, args.commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
