"""Benchmark the vLLM plugin on the CPU: tokens/s of a tiny MoE model with and without it, and
the dispatcher's per-call overhead.

    python scripts/bench_vllm_plugin.py [--out bench/results/vllm-plugin-cpu-DATE.md]

Steps: save the tiny random Mixtral of the engine tests (float32), tune its shape with
``moetune tune --config`` at the benchmark's num_tokens, then run vLLM's real engine twice in
fresh processes (MOETUNE_MODE=off, then lookup with that table), each timing greedy generation
after a warm-up. Writes a Markdown report with the machine, date, commit and command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
BATCH, PROMPT_LEN, MAX_TOKENS, REPEATS = 8, 32, 64, 5


def child(model: str, out: str) -> None:
    """One engine in this process: warm up, then time ``REPEATS`` greedy generations."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from moetune.runtime import vllm_plugin

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
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
    Path(out).write_text(json.dumps({"rates": rates, "stats": vllm_plugin.stats(),
                                     "tokens": [list(o.outputs[0].token_ids) for o in outputs]}))


def engine(model: Path, out: Path, **env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MOETUNE_")} | env
    proc = subprocess.run([sys.executable, __file__, "--child", str(model), str(out)], env=full,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.exit(f"engine run failed ({env}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def dispatch_overhead(table: Path, shape) -> dict[str, float]:
    """Nanoseconds per call: ``Dispatcher.select`` on a (memoized) hit, and the hook's own work
    around vLLM's ``apply`` on a miss (wrapper vs. calling the no-op apply directly)."""
    import torch

    from moetune.runtime import vllm_hook
    from moetune.runtime.dispatcher import Dispatcher
    from moetune.runtime.kernels.base import WeightLayout
    from moetune.runtime.platform import detect_sku
    from moetune.runtime.problem import MoEProblem
    from moetune.runtime.vllm_state import PluginState, Settings

    n = 200_000
    dispatcher = Dispatcher.load(table, detect_sku("cpu"))
    problem = shape.problem(8)
    dispatcher.select(problem)
    select_ns = timeit.timeit(lambda: dispatcher.select(problem), number=n) / n * 1e9
    row = problem.to_row()
    problem_ns = timeit.timeit(lambda: MoEProblem(**row), number=n // 10) / (n // 10) * 1e9

    def noop(self, *args):
        return None

    spec = vllm_hook.ExpertsSpec("bench", "Experts", WeightLayout.PLAIN, False)
    state = PluginState(Settings(table=table))
    # A layer moetune leaves to vLLM (gelu_tanh): every call is a miss through the hook.
    experts_cls = type("Experts", (), {"apply": vllm_hook._wrap_apply(noop, spec, state,
                                                                     lambda: False)})
    experts = experts_cls()
    experts.moe_config = SimpleNamespace(activation=SimpleNamespace(value="gelu_tanh"),
                                         in_dtype=torch.float32, experts_per_token=2)
    experts.quant_config = SimpleNamespace(is_quantized=False, weight_quant_dtype=None)
    experts.w1_bias = experts.w2_bias = None
    x, w = torch.zeros(8, shape.hidden_size), torch.zeros(8, 2)
    w13 = torch.zeros(shape.num_experts, 2 * shape.intermediate_size, shape.hidden_size)
    args = (None, x, w13, w13, w, w, None, shape.num_experts, None, None, None, None, None, None,
            False)
    experts.apply(*args)
    hook_ns = timeit.timeit(lambda: experts.apply(*args), number=n) / n * 1e9
    bare_ns = timeit.timeit(lambda: noop(experts, *args), number=n) / n * 1e9
    return {"select_hit_ns": select_ns, "problem_build_ns": problem_ns,
            "hook_miss_overhead_ns": hook_ns - bare_ns}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in
                   Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}"


def commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + (" (dirty tree)" if git("status", "--porcelain")
                                                  else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    today = datetime.date.today().isoformat()
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / f"vllm-plugin-cpu-{today}.md")
    args = parser.parse_args()
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
        off = engine(model, work / "off.json", MOETUNE_MODE="off")
        on = engine(model, work / "on.json", MOETUNE_MODE="lookup", MOETUNE_TABLE=str(table))
        shown = subprocess.run(["moetune", "show", str(table)], capture_output=True, text=True,
                               check=True, env=os.environ | {"COLUMNS": "140"}).stdout
        overhead = dispatch_overhead(table, shape)

    def rate(r: dict) -> str:
        return (f"{statistics.median(r['rates']):.1f} tok/s (min {min(r['rates']):.1f}, "
                f"max {max(r['rates']):.1f})")

    (counts,) = on["stats"]["counters"].values()
    speed = statistics.median(on["rates"]) / statistics.median(off["rates"])
    report = f"""# vLLM plugin on the CPU: tiny Mixtral with and without moetune

- date: {today}
- machine: {machine()}
- versions: torch {torch.__version__}, vllm {importlib.metadata.version('vllm-cpu')}
- commit: {commit()}
- command: `python scripts/bench_vllm_plugin.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`

Model: random Mixtral-style, hidden 128, 8 experts (intermediate 64), top-2, 2 layers, float32.
Workload: {BATCH} prompts x {PROMPT_LEN} tokens, {MAX_TOKENS} greedy tokens each
(`ignore_eos`), vLLM engine in-process (`uni` executor, `enforce_eager`), median of {REPEATS}
timed runs after one warm-up. Table: `moetune tune --config ... --buckets {buckets}
--trials 12 --device cpu` on this machine.

| plugin | tokens/s |
| --- | --- |
| off (vLLM's `CPUUnquantizedExperts`) | {rate(off)} |
| lookup (table winners) | {rate(on)} |

With the plugin / without: **{speed:.2f}x**. Same greedy tokens: {on['tokens'] == off['tokens']}.
Worker counters with the plugin: {counts['hit']} hits, {counts['miss']} misses,
{counts['fallback']} fallbacks ({on['stats']['layers']} MoE layers).

Per-call overhead (single thread, {platform.python_implementation()}):

| what | ns per call |
| --- | --- |
| `Dispatcher.select` on a hit (memoized) | {overhead['select_hit_ns']:.0f} |
| building a `MoEProblem` (what the hook avoids per call) | {overhead['problem_build_ns']:.0f} |
| the hook around vLLM's `apply` on a miss (plan lookup + counter) | {overhead['hook_miss_overhead_ns']:.0f} |

The table used:

```
{shown.strip()}
```

Note: the tuner's CPU baseline is `torch_loop` (runtime/rules.py), not vLLM's C++
`cpu_fused_moe`, so the table's "speedup" column is not the speedup over what vLLM runs on the
CPU; the tokens/s rows above are.
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
