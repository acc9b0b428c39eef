"""Benchmark the vLLM plugin on the CPU: tokens/s of a tiny MoE model with and without it, and
the dispatcher's per-call overhead.

    python scripts/bench_vllm_plugin.py [--rounds 6] [--out bench/results/vllm-plugin-cpu-DATE.md]
    python scripts/bench_vllm_plugin.py --hook-cost [--rounds 3]   # vllm-hook-cost-cpu-DATE.md

Steps: save the tiny random Mixtral of the engine tests (float32), tune its shape with
``moetune tune --config`` at the benchmark's num_tokens (the baseline is the CPU rule's pick:
vLLM's own CPU kernel), then run vLLM's real engine in fresh processes, MOETUNE_MODE=off and
lookup with that table, one process of each per round in shuffled order (so drift on the
machine hits both alike), ``--rounds`` rounds eager and then compiled; each process times
greedy generation after a warm-up and lists the ops of one profiled generate. Writes a
Markdown report with the machine, date, commit and command. ``--hook-cost`` runs only the
lookup engines (eager) and reports the hook's own cost per MoE call, in the engine and alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))
from vllm_bench_common import ROOT, commit, machine, run_child  # noqa: E402

BATCH, PROMPT_LEN, MAX_TOKENS, REPEATS = 8, 32, 64, 5
HOOK_PAIRS = 50_000  # hooked / vLLM's own call pairs timed per process


def noop_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
               global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
               expert_tokens_meta, apply_router_weight_on_input):
    """vLLM's experts ``apply``, doing nothing: what is left is the hook's own cost."""
    return None


def child(model: str, out: str, compiled: bool) -> None:
    """One engine in this process: warm up, then time ``REPEATS`` greedy generations."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from moetune import serving as moetune_vllm

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=not compiled, max_model_len=256,
              gpu_memory_utilization=0.3, dtype="float32", seed=0,
              distributed_executor_backend="uni")
    prompts = [{"prompt_token_ids": [(7 * b + 3 * i) % 500 + 1 for i in range(PROMPT_LEN)]}
               for b in range(BATCH)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    rates = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:  # which ops ran, not their time
        llm.generate(prompts, params, use_tqdm=False)
    ops = {e.key: e.count for e in prof.key_averages()}
    stats = moetune_vllm.stats()  # before hook_cost's own calls
    cost = hook_cost(llm, prompts, params) if stats and not compiled else None
    Path(out).write_text(json.dumps({"rates": rates, "stats": stats, "ops": ops,
                                     "hook_cost": cost,
                                     "tokens": [list(o.outputs[0].token_ids) for o in outputs]}))


def hook_cost(llm, prompts, params) -> dict[str, float]:
    """Eager, in the engine: the hook's cost per MoE call, timed on a real decode-step call
    (its experts object and arguments), and how many MoE calls one generate makes.

    Calls through the hooked ``apply`` and through vLLM's own alternate one by one, each timed;
    the cost is the median of the pairs' differences, so a burst of load on a shared machine
    (which slows vLLM's threaded kernel by far more than the hook costs) hits a few pairs, not
    the estimate. vLLM's kernel runs on one thread meanwhile, for the same reason."""
    import torch

    from moetune.runtime.vllm import classes
    from moetune.serving import hook

    cls = classes.CPU_SPECS[0].load()
    hooked = cls.__dict__["apply"]
    original = hook.original(cls)
    seen: list[tuple[object, dict]] = []
    calls = 0

    def spy(self, **kwargs):
        nonlocal calls
        calls += 1
        if not seen and kwargs["hidden_states"].shape[0] == BATCH:
            seen.append((self, kwargs))
        return hooked(self, **kwargs)

    cls.apply = spy
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        cls.apply = hooked
    experts, kwargs = seen[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    clock, with_hook, without = time.perf_counter_ns, [], []
    try:
        for i in range(HOOK_PAIRS):
            for fn, times in ((hooked, with_hook), (original, without))[::1 if i % 2 else -1]:
                start = clock()
                fn(experts, **kwargs)
                times.append(clock() - start)
    finally:
        torch.set_num_threads(threads)
    layer = experts.__dict__[hook._ATTR]
    step = layer.steps[BATCH]
    layer.original, n, alone, bare = noop_apply, 20_000, [], []
    for _ in range(15):  # the hook alone: the same call, vLLM's kernel a no-op
        alone.append(timeit.timeit(lambda: hooked(experts, **kwargs), number=n) / n)
        bare.append(timeit.timeit(lambda: noop_apply(experts, **kwargs), number=n) / n)
    return {"calls": calls, "pairs": HOOK_PAIRS,
            "alone_us": (min(alone) - min(bare)) * 1e6,
            "hooked_us": statistics.median(with_hook) / 1e3,
            "vllm_us": statistics.median(without) / 1e3,
            "hook_us": statistics.median(a - b for a, b in zip(with_hook, without)) / 1e3,
            "step": "moetune kernel" if step.fn is not None else f"vLLM's apply ({step.counter})"}


def engine(model: Path, out: Path, compiled: bool, **env: str) -> dict:
    return run_child(__file__, [str(model), str(out), str(int(compiled))], out, **env)


def dispatch_overhead(table: Path, shape) -> dict[str, float]:
    """Nanoseconds per call: ``Dispatcher.select`` on a (memoized) hit (the hook no longer calls
    it per call), and the hook's own work around vLLM's ``apply`` when vLLM's kernel runs (a
    winner that is the rule's pick, or a layer moetune leaves to vLLM), as the wrapper vs.
    calling the no-op apply directly."""
    import torch

    from moetune.runtime.dispatcher import Dispatcher
    from moetune.runtime.platform import detect_sku
    from moetune.runtime.problem import MoEProblem
    from moetune.runtime.vllm import classes
    from moetune.serving import hook
    from moetune.serving.settings import Settings
    from moetune.serving.state import PluginState

    n = 200_000
    dispatcher = Dispatcher.load(table, detect_sku("cpu"))
    problem = shape.problem(8)
    dispatcher.select(problem)
    select_ns = timeit.timeit(lambda: dispatcher.select(problem), number=n) / n * 1e9
    row = problem.to_row()
    problem_ns = timeit.timeit(lambda: MoEProblem(**row), number=n // 10) / (n // 10) * 1e9

    spec = classes.ExpertsSpec("bench", "Experts", classes.Held.PLAIN)
    state = PluginState(Settings(table=table))
    experts_cls = type("Experts", (), {"apply": noop_apply})
    experts_cls.apply = hook._wrap_apply(experts_cls, spec, state, lambda: False)
    x, w = torch.zeros(8, shape.hidden_size), torch.zeros(8, 2)
    w13 = torch.zeros(shape.num_experts, 2 * shape.intermediate_size, shape.hidden_size)
    w2 = torch.zeros(shape.num_experts, shape.hidden_size, shape.intermediate_size)
    args = dict(output=torch.zeros(8, shape.hidden_size), hidden_states=x, w1=w13, w2=w2,
                topk_weights=w, topk_ids=w.int(), activation=None,
                global_num_experts=shape.num_experts, expert_map=None, a1q_scale=None,
                a2_scale=None, workspace13=None, workspace2=None, expert_tokens_meta=None,
                apply_router_weight_on_input=False)
    hook_ns = {}
    # The model's layer (in the table: its plan at 8 tokens) and one moetune leaves to vLLM
    # (gelu_tanh), both with vLLM's apply a no-op, as vLLM calls it (by keyword).
    for case, activation in (("table", "silu"), ("not handled", "gelu_tanh")):
        experts = experts_cls()
        experts.moe_config = SimpleNamespace(activation=SimpleNamespace(value=activation),
                                             in_dtype=torch.float32, experts_per_token=2)
        experts.quant_config = SimpleNamespace(is_quantized=False, weight_quant_dtype=None,
                                               gemm1_alpha=None, gemm1_clamp_limit=None)
        experts.w1_bias = experts.w2_bias = None
        experts.apply(**args)
        step = experts.__dict__[hook._ATTR].steps[8]
        if step.fn is not None:  # the table's winner at 8 tokens is a moetune kernel
            continue
        hook_ns[case] = min(timeit.repeat(lambda: experts.apply(**args), number=n // 4,
                                          repeat=5)) / (n // 4) * 1e9
    bare_ns = min(timeit.repeat(lambda: noop_apply(experts, **args), number=n // 4,
                                repeat=5)) / (n // 4) * 1e9
    return {"select_hit_ns": select_ns, "problem_build_ns": problem_ns,
            **{f"hook_overhead_ns ({case})": ns - bare_ns for case, ns in hook_ns.items()}}


def overhead_rows(overhead: dict[str, float]) -> str:
    """The hook-overhead rows of the per-call table (a case is absent where the table's winner
    at 8 tokens is a moetune kernel: its time is the kernel's)."""
    return "\n".join(f"| the hook around vLLM's no-op `apply`, layer {k.split('(')[1][:-1]} "
                     f"(plan lookup + counter) | {v:.0f} |"
                     for k, v in overhead.items() if k.startswith("hook_overhead_ns"))


def hook_cost_report(today: str, lookups: list[dict], overhead: dict[str, float],
                     args: argparse.Namespace) -> str:
    """The ``--hook-cost`` report: the hook's cost per MoE call in each engine process."""
    import importlib.metadata

    import torch

    costs = [run["hook_cost"] for run in lookups]
    rows = "\n".join(f"| {i + 1} | {c['alone_us']:.2f} | {c['vllm_us']:.2f} | "
                     f"{c['hooked_us']:.2f} | {c['hook_us']:.2f} | {c['step']} |"
                     for i, c in enumerate(costs))
    alone = statistics.median(c["alone_us"] for c in costs)
    extra = statistics.median(c["hook_us"] for c in costs)
    counts = next(iter(lookups[0]["stats"]["counters"].values()))
    command = " ".join(["python", "scripts/bench_vllm_plugin.py", *sys.argv[1:]])
    return f"""# vLLM plugin on the CPU: the hook's cost per MoE call

- date: {today}
- machine: {machine()}, no GPU
- versions: torch {torch.__version__}, vllm {importlib.metadata.version('vllm-cpu')}
- commit: {commit()}
- command: `{command}`

Model: random Mixtral-style, hidden 128, 8 experts (intermediate 64), top-2, 2 layers, float32;
vLLM's engine in-process, eager (`enforce_eager`), MOETUNE_MODE=lookup with a table tuned here
(`moetune tune --config ... --buckets 1,{BATCH},{BATCH * PROMPT_LEN} --trials 12 --device cpu`).
In each of {args.rounds} engine processes, one real decode-step MoE call ({BATCH} tokens: its
experts object and arguments, captured during a generate) is timed two ways:

- *hook alone*: the layer's vLLM `apply` replaced by a no-op with its signature, the call made
  through the hook and straight to the no-op (by keyword, as vLLM calls), alternately, 15 x 20000
  calls each; the difference of the fastest blocks is what the hook itself adds to a call;
- *with vLLM's kernel*: {costs[0]['pairs']} calls through the hooked `apply` and as many through
  vLLM's own, alternating call by call (vLLM's kernel on one thread), each timed; the median of
  the pairs' differences, which also holds whatever the hook's Python does to the kernel that
  follows it (caches, the other threads of the engine process).

| process | hook alone us | vLLM's `apply` us | through the hook us | paired difference us | what ran at {BATCH} tokens |
| --- | --- | --- | --- | --- | --- |
{rows}

**The hook's own cost: {alone:.2f} us per MoE call** (median of the processes; goal <= 2 us);
with vLLM's kernel after it, {extra:.2f} us per call (paired median). {costs[0]['calls']} MoE
calls per generate. Worker counters of the first process: {counts['hit']} hits,
{counts['miss']} misses, {counts['fallback']} fallbacks. Before the adapter refactor this page's
predecessor reported 0.74 us (`bench/results/vllm-plugin-cpu-2026-11-30.md`, the fastest of 5
blocks with vLLM's kernel on a quieter machine); that method gives no stable number on this
machine today (blocks differ by more than the hook costs).

The same hook alone (single thread, vLLM's `apply` replaced by a no-op, called by keyword as vLLM
calls it):

| what | ns per call |
| --- | --- |
| `Dispatcher.select` on a hit (memoized; no longer called per MoE call) | {overhead['select_hit_ns']:.0f} |
{overhead_rows(overhead)}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    today = datetime.date.today().isoformat()
    parser.add_argument("--rounds", type=int, default=6,
                        help="engine processes per mode (one of each per round, shuffled)")
    parser.add_argument("--hook-cost", action="store_true",
                        help="only the hook's per-call cost (eager lookup engines, --rounds)")
    parser.add_argument("--out", type=Path, help="default bench/results/vllm-plugin-cpu-DATE.md "
                        "(--hook-cost: vllm-hook-cost-cpu-DATE.md)")
    args = parser.parse_args()
    name = "vllm-hook-cost-cpu" if args.hook_cost else "vllm-plugin-cpu"
    args.out = args.out or ROOT / "bench" / "results" / f"{name}-{today}.md"
    sys.path.insert(0, str(ROOT))
    import importlib.metadata

    import torch

    from tests.vllm_tables import model_shape, tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = tiny_model("mixtral", work / "mixtral")
        shape = model_shape(model)
        buckets = f"1,{BATCH},{BATCH * PROMPT_LEN}"
        table = work / "table.db"
        tune = ["moetune", "tune", "--config", str(model / "config.json"), "--dtype", "float32",
                "--buckets", buckets, "--trials", "12", "--device", "cpu", "--output", str(table)]
        subprocess.run(tune, check=True, capture_output=True)
        if args.hook_cost:
            lookups = [engine(model, work / f"lookup-{i}.json", False, MOETUNE_MODE="lookup",
                              MOETUNE_TABLE=str(table)) for i in range(args.rounds)]
            report = hook_cost_report(today, lookups, dispatch_overhead(table, shape), args)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(report)
            print(report)
            return
        runs: dict[tuple[bool, str], list[dict]] = {}
        order = random.Random(0)
        for compiled in (False, True):
            for i in range(args.rounds):  # one process of each mode per round, in random order
                modes = [("off", {}), ("lookup", {"MOETUNE_TABLE": str(table)})]
                order.shuffle(modes)
                for mode, env in modes:
                    out = work / f"{mode}-{int(compiled)}-{i}.json"
                    runs.setdefault((compiled, mode), []).append(
                        engine(model, out, compiled, MOETUNE_MODE=mode, **env))
        shown = subprocess.run(["moetune", "show", str(table)], capture_output=True, text=True,
                               check=True, env=os.environ | {"COLUMNS": "140"}).stdout
        overhead = dispatch_overhead(table, shape)

    def pooled(compiled: bool, mode: str) -> list[float]:
        return [r for run in runs[(compiled, mode)] for r in run["rates"]]

    def rate(compiled: bool, mode: str) -> str:
        rates = pooled(compiled, mode)
        return f"{statistics.median(rates):.1f} (min {min(rates):.1f}, max {max(rates):.1f})"

    def ratio(compiled: bool) -> float:
        return statistics.median(pooled(compiled, "lookup")) / statistics.median(
            pooled(compiled, "off"))

    def per_round(compiled: bool) -> str:
        return ", ".join(
            f"{statistics.median(b['rates']) / statistics.median(a['rates']):.3f}x"
            for a, b in zip(runs[(compiled, "off")], runs[(compiled, "lookup")]))

    def ops(compiled: bool, mode: str) -> dict[str, int]:
        """Torch ops of one profiled generate (wrappers such as Dynamo's and the profiler's own
        ranges left out)."""
        return {k: n for k, n in runs[(compiled, mode)][0]["ops"].items() if "::" in k}

    def same_ops(compiled: bool) -> str:
        off_ops, on_ops = ops(compiled, "off"), ops(compiled, "lookup")
        if off_ops == on_ops:
            return f"identical ({len(off_ops)} ops, {sum(off_ops.values())} calls)"
        diff = sorted(set(off_ops.items()) ^ set(on_ops.items()))
        return "different: " + ", ".join(f"{k} x{n}" for k, n in diff[:8])

    def moe_calls(compiled: bool, mode: str) -> str:
        found = ops(compiled, mode)
        return ", ".join(f"`{k}` x{found.get(k, 0)}"
                         for k in ("_C::cpu_fused_moe", "moetune::experts_apply"))

    costs = [run["hook_cost"] for run in runs[(False, "lookup")]]
    hook_us = statistics.median(c["hook_us"] for c in costs)
    calls = costs[0]["calls"]
    generate_us = BATCH * MAX_TOKENS / max(pooled(False, "off")) * 1e6  # the fastest generate
    estimate = generate_us / (generate_us + calls * hook_us)

    def spread(compiled: bool) -> float:
        """How far apart processes of the same mode (off) land: max / min of their medians."""
        medians = [statistics.median(r["rates"]) for r in runs[(compiled, "off")]]
        return max(medians) / min(medians) - 1

    tokens = [run["tokens"] for group in runs.values() for run in group]
    same_tokens = all(t == tokens[0] for t in tokens)
    stats = {c: runs[(c, "lookup")][0]["stats"] for c in (False, True)}
    counts = {c: next(iter(stats[c]["counters"].values())) for c in (False, True)}
    report = f"""# vLLM plugin on the CPU: tiny Mixtral with and without moetune

- date: {today}
- machine: {machine()}
- versions: torch {torch.__version__}, vllm {importlib.metadata.version('vllm-cpu')}
- commit: {commit()}
- command: `python scripts/bench_vllm_plugin.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`

Model: random Mixtral-style, hidden 128, 8 experts (intermediate 64), top-2, 2 layers, float32.
Workload: {BATCH} prompts x {PROMPT_LEN} tokens, {MAX_TOKENS} greedy tokens each
(`ignore_eos`), vLLM engine in-process (`uni` executor), eager (`enforce_eager`) and compiled
(vLLM's default on the CPU: Dynamo traces the model, MoE layers included). {REPEATS} timed runs
after one warm-up per engine process; {args.rounds} processes per row, one off and one
lookup per round in shuffled order; each row pools the {REPEATS * args.rounds} runs of its
processes. Table: `moetune tune --config ... --buckets {buckets} --trials 12 --device cpu` on
this machine.

| vLLM | plugin | tokens/s, median (min, max) | with / without |
| --- | --- | --- | --- |
| `enforce_eager` | off (vLLM's `CPUUnquantizedExperts`) | {rate(False, "off")} | |
| `enforce_eager` | lookup (table winners) | {rate(False, "lookup")} | **{ratio(False):.3f}x** |
| `torch.compile` (vLLM's CPU default) | off | {rate(True, "off")} | |
| `torch.compile` (vLLM's CPU default) | lookup | {rate(True, "lookup")} | **{ratio(True):.3f}x** |

With / without per round: eager {per_round(False)}; compiled {per_round(True)}.
Same greedy tokens in every run: {same_tokens}. Processes of the same mode (off) differ by up to
{spread(False):.0%} (eager) and {spread(True):.0%} (compiled) here, so these rows bound the
plugin's effect only that closely; the two measurements below do not depend on that noise.

The hook's own cost, timed in the engine (eager; a real decode-step call, median of
{len(costs)} processes): vLLM's `apply` {statistics.median(c["vllm_us"] for c in costs):.2f} us,
through the hook {statistics.median(c["hooked_us"] for c in costs):.2f} us: **{hook_us:.2f} us per
MoE call**, {calls} MoE calls per generate, against {generate_us / 1e3:.1f} ms for the fastest
generate without the plugin: with / without **{estimate:.4f}x** from the hook alone. Compiled,
the graphs hold the same ops (below), so the plugin adds nothing per step.

Ops of one profiled generate (torch profiler; off vs lookup): eager {same_ops(False)};
compiled {same_ops(True)}. MoE ops with the plugin: eager {moe_calls(False, "lookup")};
compiled {moe_calls(True, "lookup")}.

Worker counters with the plugin (first lookup process of each kind): eager {counts[False]['hit']}
hits, {counts[False]['miss']} misses, {counts[False]['fallback']} fallbacks; compiled
{counts[True]['hit']} hits, {counts[True]['miss']} misses, {counts[True]['fallback']} fallbacks
({stats[False]['layers']} MoE layers). Plain weight copies kept: {stats[False]['plain_copy_bytes']}
bytes. A hit whose winner is the rule's pick (`vllm_cpu_experts`) is served by vLLM's own `apply`;
only other winners run moetune kernels. Compiled, a layer whose winners are all the rule's pick
traces vLLM's own `apply` (no moetune op in the graph), so its calls are not counted.

Per-call overhead (single thread, {platform.python_implementation()}):

| what | ns per call |
| --- | --- |
| `Dispatcher.select` on a hit (memoized) | {overhead['select_hit_ns']:.0f} |
| building a `MoEProblem` (what the hook avoids per call) | {overhead['problem_build_ns']:.0f} |
{overhead_rows(overhead)}

The table used:

```
{shown.strip()}
```

Baseline: the CPU rule (runtime/rules.py) is `vllm_cpu_experts`, vLLM's own C++ `cpu_fused_moe`
on weights prepacked as vLLM prepacks them, so the table's "speedup" column is over what vLLM
runs on this CPU.
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4] == "1")
    else:
        main()
