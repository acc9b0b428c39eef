"""The Markdown report of ``scripts/bench_vllm_e2e.py``: throughput, decode latency, where the GPU
time goes, greedy tokens and the plugin's log and counters, from every engine process's
results (``child``'s JSON)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter

from vllm_bench_common import machine

#: The greedy check of every process: prompts, prompt length, output tokens.
CHECK_REQUESTS, CHECK_PROMPT, CHECK_OUTPUT = 8, 64, 32
#: Names of the kernels vLLM's ``TritonExperts.apply`` launches (the part moetune serves): its
#: Triton GEMM, the align/sort and top-k sum of ``_moe_C``, the activation of ``_C``, and the
#: activation quantization of fp8 layers. The router (top-k softmax) stays vLLM's either way.
VLLM_EXPERTS_KERNELS = ("fused_moe_kernel", "moe_align_block_size", "count_and_sort_expert",
                        "moe_sum", "act_and_mul_kernel", "per_token_group_quant",
                        "scaled_fp8_quant", "dynamic_per_token_scaled_fp8_quant")
PROFILE_NOTE = ("Windows: `decode`, the largest batch of 128-token prompts generating 64 tokens; "
                "`prefill`, as many 1000-token prompts generating 1. vLLM's experts kernels are "
                "those named in `VLLM_EXPERTS_KERNELS`; the lookup process's MoE time is its GPU "
                "time less the off process's other kernels (the same model, batch and lengths).")


def moe_split(times: dict[str, float]) -> tuple[float, float]:
    """(vLLM's experts kernels, everything else) of a profile, in µs."""
    moe = sum(t for name, t in times.items() if any(k in name for k in VLLM_EXPERTS_KERNELS))
    return moe, sum(times.values()) - moe


def compare(a: list[dict], b: list[dict]) -> dict:
    """How far two greedy checks agree: requests with the same tokens, the first position where
    each differing request diverges, ``a``'s margin there (top-1 less top-2 log-probability,
    where recorded: a flip where the margin is below the log-probability differences is
    rounding, not a wrong kernel), and the largest log-probability difference of the same
    tokens before that."""
    same, first, margins, dlp = 0, [], [], 0.0
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t),
                 len(x["tokens"]))
        same += n == len(x["tokens"])
        if n < len(x["tokens"]):
            first.append(n)
            if "margins" in x:
                margins.append(x["margins"][n])
        dlp = max([dlp] + [abs(p - q) for p, q in zip(x["logprobs"][:n], y["logprobs"][:n])])
    return {"same": same, "of": len(a), "diverge_at": first, "margins_at": margins,
            "max_dlogprob": dlp}


def own_mode_cell(runs: list[dict], i: int) -> str:
    """Run ``i``'s greedy check against the first run of its own mode: a process of a
    deterministic mode matches it exactly; atomics in a kernel show here as differences."""
    first = next(j for j, r in enumerate(runs) if r["mode"] == runs[i]["mode"])
    if first == i:
        return "-"
    c = compare(runs[first]["check"], runs[i]["check"])
    return f"{c['same']}/{c['of']} ({c['max_dlogprob']:.3g})"


def margin_note(check: list[dict]) -> str:
    """The margins of a greedy check's positions: how near ties its tokens are."""
    margins = sorted(m for x in check for m in x.get("margins", []))
    if not margins:
        return "Margins were not recorded in these runs."
    small = sum(m < 0.1 for m in margins)
    return (f"Margins of the first off process (top-1 less top-2 log-probability, all "
            f"{len(margins)} positions): median {statistics.median(margins):.3g}, smallest "
            f"{margins[0]:.3g}; {small} under 0.1.")


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(a) / statistics.median(b)


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def throughput_rows(by_mode: dict[str, list[dict]]) -> list[str]:
    """One row per case and mode; the lookup row has lookup / off of the output tokens/s,
    pooled and per round."""
    rows = []
    for c, case in enumerate(by_mode["off"][0]["throughput"]):
        def rates(runs: list[dict], key: str = "output_tokens_per_s") -> list[float]:
            return [x[key] for r in runs for x in r["throughput"][c]["runs"]]

        for mode in ("off", "lookup"):
            ratio = ""
            if mode == "lookup":
                rounds = ", ".join(f"{_median_ratio(rates([b]), rates([a])):.3f}"
                                   for a, b in zip(by_mode["off"], by_mode["lookup"]))
                pooled = _median_ratio(rates(by_mode["lookup"]), rates(by_mode["off"]))
                ratio = f"**{pooled:.3f}x** (per round {rounds})"
            rows.append(f"| {case['prompt']}/{case['output']} x {case['requests']} | {mode} | "
                        f"{_cell(rates(by_mode[mode], 'requests_per_s'))} | "
                        f"{_cell(rates(by_mode[mode]))} | "
                        f"{_cell(rates(by_mode[mode], 'total_tokens_per_s'))} | {ratio} |")
    return rows


def latency_rows(by_mode: dict[str, list[dict]]) -> list[str]:
    """One row per batch: time per output token and prefill, off and lookup."""
    rows = []
    for b, lat in enumerate(by_mode["off"][0]["latency"]):
        tpot = {m: [r["latency"][b]["tpot_ms"] for r in runs] for m, runs in by_mode.items()}
        prefill = {m: [r["latency"][b]["prefill_s"] * 1e3 for r in runs]
                   for m, runs in by_mode.items()}
        rows.append(f"| {lat['batch']} | {lat['prompt']}/{lat['output']} | {_cell(tpot['off'])} "
                    f"| {_cell(tpot['lookup'])} | "
                    f"**{_median_ratio(tpot['off'], tpot['lookup']):.3f}x** | "
                    f"{_cell(prefill['off'])} | {_cell(prefill['lookup'])} |")
    return rows


def profile_rows(by_mode: dict[str, list[dict]]) -> list[str]:
    """One row per profiled window and process pair: the off process's GPU time and its experts
    kernels' share, the lookup process's GPU time, the MoE time that implies (its GPU time less
    the off process's other kernels) and so the MoE speedup, and the end-to-end speedup of GPU
    time."""
    rows = []
    for off, lookup in zip(by_mode["off"], by_mode["lookup"]):
        for window in off.get("profile", {}):
            moe, other = moe_split(off["profile"][window])
            total_off = (moe + other) / 1e3
            total_lookup = sum(lookup["profile"][window].values()) / 1e3
            moe_lookup = total_lookup - other / 1e3
            rows.append(f"| {window} | {total_off:.1f} | {moe / 1e3:.1f} "
                        f"({moe / (moe + other):.1%}) | {total_lookup:.1f} | {moe_lookup:.1f} | "
                        f"{moe / 1e3 / moe_lookup:.3f}x | {total_off / total_lookup:.3f}x |")
    return rows


def timings(args: argparse.Namespace, by_mode: dict[str, list[dict]]) -> str:
    """The throughput and decode-latency sections, or why there are none."""
    if not (by_mode["lookup"] and by_mode["off"][0]["throughput"]):
        return "## Throughput and decode latency\n\nNot timed: `--check-only`.\n"
    nl = "\n"
    return f"""## Throughput (median over {args.repeats} runs x {args.rounds} processes; min-max)

| prompt/output x requests | MOETUNE_MODE | requests/s | output tokens/s | total tokens/s | lookup / off (output tokens/s) |
| --- | --- | --- | --- | --- | --- |
{nl.join(throughput_rows(by_mode))}

## Decode latency (time per output token, ms; prefill = generate with 1 output token, ms)

| batch | prompt/output | TPOT off | TPOT lookup | off / lookup | prefill off | prefill lookup |
| --- | --- | --- | --- | --- | --- | --- |
{nl.join(latency_rows(by_mode))}
"""


def report(args: argparse.Namespace, config: dict, runs: list[dict], today: str) -> str:
    """The Markdown report of all processes (``runs``, in the order they ran)."""
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in ("off", "lookup")}
    first = runs[0]
    reference = by_mode["off"][0]["check"]
    checks = "\n".join(
        f"| {i + 1} | {r['mode']} | {c['same']}/{c['of']} | "
        f"{', '.join(map(str, c['diverge_at'])) or '-'} | "
        f"{', '.join(f'{m:.3g}' for m in c['margins_at']) or '-'} | {c['max_dlogprob']:.3g} | "
        f"{own_mode_cell(runs, i)} |"
        for i, r in enumerate(runs) for c in [compare(reference, r["check"])])
    stats = [r["stats"] for r in by_mode["lookup"]]
    counters = "\n".join(f"| {i + 1} | {label} | {c.get('hit', 0)} | {c.get('miss', 0)} | "
                         f"{c.get('fallback', 0)} |"
                         for i, s in enumerate(stats) for label, c in s.get("counters", {}).items())
    table = stats[0].get("table") if stats and stats[0] else None
    moe = (f"hidden {config['hidden_size']}, "
           f"{config.get('num_local_experts') or config.get('num_experts')} experts "
           f"(intermediate {config.get('moe_intermediate_size') or config['intermediate_size']}), "
           f"top-{config['num_experts_per_tok']}, {config['num_hidden_layers']} layers, "
           f"vocabulary {config['vocab_size']}")
    command = " ".join(["python", "scripts/bench_vllm_e2e.py", *sys.argv[1:]])
    startup = ", ".join(f"{r['startup_s']:.0f}" for r in runs)
    per_mode = ", ".join(f"{n} {m}" for m, n in Counter(r["mode"] for r in runs).items())
    nl = "\n"
    weights = "" if args.vllm_dummy_weights else ", scaled to variance 1/fan-in, norms about 1"
    execution = ("`enforce_eager`" if args.eager
                 else "vLLM's default compilation and CUDA graphs")
    return f"""# vLLM end to end with and without moetune: {args.preset}, {first['device']}

- date: {today}
- device: {first['device']}; host {machine()}
- versions: vLLM {first['vllm']}, torch {first['torch']}
- commit: {args.commit}
- command: `{command}`
- model: {args.preset} ({config['architectures'][0]}), {moe}, {args.dtype}, random weights
  (`load_format="dummy"`{weights}), {execution}, prefix caching off, attention
  {args.attention or "vLLM's default"}, max model length {args.max_model_len}
- processes: {per_mode}, one of each mode per round in shuffled order
  ({', '.join(r['mode'] for r in runs)}); engine startup {startup} s
- table (lookup): {json.dumps(table) if table else "none read (no MoE call reached the plugin)"}

{timings(args, by_mode)}
## Greedy tokens against the first off process ({CHECK_REQUESTS} prompts of {CHECK_PROMPT} tokens, {CHECK_OUTPUT} output tokens)

| process | mode | requests with the same tokens | first differing positions | off's margin there | largest log-prob difference before them | against the first process of its mode: same tokens (largest log-prob difference) |
| --- | --- | --- | --- | --- | --- | --- |
{checks}

{margin_note(reference)}

## Where the GPU time goes (`--profile`; ms of kernel time in each window, per round)

{PROFILE_NOTE}

| window | off: GPU time | off: vLLM's experts kernels (share) | lookup: GPU time | lookup: MoE time implied | MoE speedup implied | GPU time off / lookup |
| --- | --- | --- | --- | --- | --- | --- |
{nl.join(profile_rows(by_mode)) or "| - | not profiled | | | | | |"}

## The plugin's log (first lines of the first process of each mode)

```
{nl.join(line for m in ("off", "lookup") for r in by_mode[m][:1] for line in r.get("plugin_log", []))}
```

## The plugin's counters (lookup processes, whole run)

| process | layer shape | hits | misses | fallbacks |
| --- | --- | --- | --- | --- |
{counters or "| - | no MoE call reached the plugin | | | |"}
"""
