"""End to end: vLLM's offline engine on a real-size MoE model with random weights, with moetune
off and on: throughput (requests/s, tokens/s) at fixed prompt/output lengths, decode latency,
the plugin's counters, and whether greedy tokens match.

    python scripts/bench_vllm_e2e.py --preset qwen3-30b-a3b [--rounds 2] [--repeats 2]
    python scripts/bench_vllm_e2e.py --preset mixtral-8x7b --layers 16   # fits 80 GB
    python scripts/bench_vllm_e2e.py ... --rounds 1 --json e2e.jsonl --resume  # a round per call
    python scripts/bench_vllm_e2e.py --preset tiny --device cpu --cases 64/64:8 --latency 1 \\
        --latency-lengths 16/32 --table tiny.db                        # the same on the CPU

The model folder is a ``config.json`` written from the preset (vLLM's ``load_format="dummy"``
gives every weight seeded random values, so nothing is downloaded; scaled here so that logits
differ, see ``scaled``); there is no tokenizer
(``skip_tokenizer_init``), so prompts are random token ids, the same in every process. Each
engine runs in its own process (engine core and worker in it: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``uni`` executor), on CUDA with vLLM's default torch.compile and CUDA graphs (``--eager``:
``enforce_eager``, the CPU's default), ``max_num_seqs`` the largest batch of the cases (so CUDA
graphs are captured for the sizes the run uses), prefix caching off, Triton attention on CUDA, with
``MOETUNE_MODE=off`` or ``lookup`` (``--table``, else the table the plugin picks for the GPU);
one process of each mode per round, in shuffled order. In each process, after a warm-up of every
case (8 output tokens):

* throughput, per case ``PROMPT/OUTPUT:REQUESTS``: ``--repeats`` timed ``generate`` calls of all
  the requests at once (greedy, ``ignore_eos``), as vLLM's ``benchmark_throughput`` counts:
  requests/s, output tokens/s, total (prompt + output) tokens/s;
* decode latency, per batch of ``--latency``: ``generate`` with 1 output token and with OUTPUT
  (``--latency-lengths PROMPT/OUTPUT``), each the median of ``--repeats``; time per output token
  = (t_OUTPUT - t_1) / (OUTPUT - 1), the prefill left out;
* a greedy check: 8 prompts of 64 tokens, 32 output tokens with their log-probabilities and
  each position's margin (top-1 less top-2 log-probability), compared across all processes: off
  with off shows the engine's own run-to-run differences, lookup with lookup the plugin's (winners
  that add a token's top-k rows with atomics, at top-k above 2, round in a different order each
  run), which shows how far rounding alone moves this model's tokens;
* with ``--profile`` (CUDA), the GPU time of every kernel in two windows under torch's profiler
  (a decode window: the largest batch of 128-token prompts generating 64 tokens; a prefill
  window: that many 1000-token prompts generating 1): vLLM's experts kernels by name give the
  MoE share of the off process's GPU time; the lookup process's MoE time is its GPU time less
  the off process's other kernels (the same model and batch), so the end-to-end gain can be
  checked against the per-layer speedup it implies.

Writes a Markdown report (``--out``) and every process's raw results (``--json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from vllm_bench_common import ROOT, commit, run_child  # noqa: E402
from vllm_e2e_report import CHECK_OUTPUT, CHECK_PROMPT, CHECK_REQUESTS, report  # noqa: E402

_MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 1e6,
            "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2}
_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "norm_topk_prob": True, "sliding_window": None, "use_sliding_window": False,
              "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645}

#: Each preset's config.json (the published models' architecture fields) and its dtype. The
#: MoE shapes are those of the tuner's presets of the same name.
PRESETS: dict[str, tuple[dict, str]] = {
    "mixtral-8x7b": (_MIXTRAL | {
        "hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768},
        "bfloat16"),
    "qwen3-30b-a3b": (_QWEN3_MOE | {
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "max_window_layers": 48, "vocab_size": 151936, "max_position_embeddings": 40960},
        "bfloat16"),
    # The tuner's "tiny" shape (hidden 128, intermediate 256, 8 experts, top-2), 2 layers.
    "tiny": (_MIXTRAL | {
        "hidden_size": 128, "intermediate_size": 256, "num_local_experts": 8,
        "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096},
        "float32"),
}
WARMUP_OUTPUT = 8
#: Lines of the plugin's log kept per process (its startup line, then one per MoE layer).
PLUGIN_LINES = 8
#: The profiled windows: (prompt, output) lengths for the largest batch of the cases.
PROFILE_WINDOWS = {"decode": (128, 64), "prefill": (1000, 1)}


def write_model(preset: str, folder: Path, layers: int | None, dtype: str) -> dict:
    """``folder/config.json`` for ``preset`` (``layers`` decoder layers if given); the config."""
    config = dict(PRESETS[preset][0], dtype=dtype)
    if layers:
        config["num_hidden_layers"] = layers
        config["max_window_layers"] = min(layers, config.get("max_window_layers", layers))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return config


def token_prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    """``n`` prompts of ``length`` random token ids (the same for the same arguments)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]}
            for _ in range(n)]


def scaled(initialize: Callable[..., None]) -> Callable[..., None]:
    """vLLM's dummy-weight initializer, then each float weight matrix scaled to variance
    1/fan_in and each vector (norms) moved to about 1, so that logits differ by O(1) and greedy
    tokens mean something (vLLM's +-1e-3 everywhere gives all but equal logits). The values stay
    vLLM's seeded ones, only scaled: the same in every process."""
    def init(param: Any, *args: Any, **kwargs: Any) -> None:
        initialize(param, *args, **kwargs)
        if param.is_floating_point() and param.element_size() >= 2 and param.dim():
            data = param.data  # parameters require grad; this is no step of a graph
            if param.dim() == 1:
                data.add_(1.0)
            else:
                data.mul_(1e3 * math.sqrt(3.0 / param.shape[-1]))
    return init


def child(spec_path: str, out: str) -> None:
    """One engine in this process: warm up, then the throughput cases, the latency batches and
    the greedy check; writes the results as JSON to ``out``."""
    spec = json.loads(Path(spec_path).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["cpu_kv_gib"]))
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    from moetune import serving

    mode = os.environ.get("MOETUNE_MODE")
    if spec["scaled_weights"]:  # the loader runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        from vllm.model_executor.model_loader import dummy_loader

        dummy_loader.initialize_single_dummy_weight = scaled(
            dummy_loader.initialize_single_dummy_weight)
    kwargs = dict(model=spec["model"], load_format="dummy", skip_tokenizer_init=True,
                  enforce_eager=spec["eager"], dtype=spec["dtype"], seed=0,
                  max_model_len=spec["max_model_len"], enable_prefix_caching=False,
                  max_num_seqs=spec["max_num_seqs"], distributed_executor_backend="uni")
    if spec["device"] == "cuda":
        kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
        # vLLM warms up CuTe DSL kernels by importing the modules of the models that have them
        # (``cutlass``: NVIDIA's CUTLASS DSL, 188 MB of wheels, not among the carried pieces);
        # none of the presets runs one. 0.34 imports MiniMax-M3's on every CUDA model, for a
        # warmup that returns at once for any other model: that module is replaced by a no-op.
        kwargs["kernel_config"] = {"enable_cutedsl_warmup": False}
        noop = types.ModuleType("vllm.model_executor.warmup.minimax_m3_msa_warmup")
        noop.minimax_m3_msa_warmup = lambda worker: None
        sys.modules[noop.__name__] = noop
    if spec["attention"]:
        kwargs["attention_config"] = {"backend": spec["attention"]}
    start = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - start
    vocab = spec["vocab_size"]

    def run(prompts: list[dict], output: int, logprobs: int | None = None) -> tuple[float, list]:
        params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True,
                                logprobs=logprobs)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, outputs

    timed = not spec["check_only"]
    cases = [(p, o, n, token_prompts(n, p, vocab, seed=i)) for i, (p, o, n) in
             enumerate(spec["cases"])] if timed else []
    for p, o, n, prompts in cases:
        run(prompts, min(o, WARMUP_OUTPUT))
    throughput = []
    for p, o, n, prompts in cases:
        runs = []
        for _ in range(spec["repeats"]):
            elapsed, outputs = run(prompts, o)
            produced = sum(len(x.outputs[0].token_ids) for x in outputs)
            runs.append({"s": elapsed, "requests_per_s": n / elapsed,
                         "output_tokens_per_s": produced / elapsed,
                         "total_tokens_per_s": (n * p + produced) / elapsed})
        throughput.append({"prompt": p, "output": o, "requests": n, "runs": runs})
    lat_prompt, lat_output = spec["latency_lengths"]
    latency = []
    for batch in spec["latency"] if timed else []:
        prompts = token_prompts(batch, lat_prompt, vocab, seed=1000 + batch)
        run(prompts, min(lat_output, WARMUP_OUTPUT))
        first = statistics.median(run(prompts, 1)[0] for _ in range(spec["repeats"]))
        full = statistics.median(run(prompts, lat_output)[0] for _ in range(spec["repeats"]))
        latency.append({"batch": batch, "prompt": lat_prompt, "output": lat_output,
                        "prefill_s": first, "generate_s": full,
                        "tpot_ms": (full - first) / (lat_output - 1) * 1e3})
    _, outputs = run(token_prompts(CHECK_REQUESTS, CHECK_PROMPT, vocab, seed=99), CHECK_OUTPUT,
                     logprobs=2)
    check = [{"tokens": list(x.outputs[0].token_ids),
              "logprobs": [lp[t].logprob for t, lp in zip(x.outputs[0].token_ids,
                                                           x.outputs[0].logprobs)],
              "margins": [margin(lp) for lp in x.outputs[0].logprobs]}
             for x in outputs]
    profiles = {}
    if spec["profile"] and timed:
        batch = max(n for _, _, n in spec["cases"])
        for window, (p, o) in PROFILE_WINDOWS.items():
            prompts = token_prompts(batch, p, vocab, seed=2000 + p)
            run(prompts, o)
            profiles[window] = kernel_times(lambda: run(prompts, o))
    device = (torch.cuda.get_device_name() if spec["device"] == "cuda" else "cpu")
    Path(out).write_text(json.dumps({
        "mode": mode,
        "startup_s": startup_s, "device": device,
        "vllm": vllm.__version__, "torch": torch.__version__, "throughput": throughput,
        "latency": latency, "check": check, "profile": profiles, "stats": serving.stats()}))


def margin(logprobs: dict) -> float:
    """How far greedy's pick at one position is from a tie: its log-probability less the
    runner-up's. A rounding difference larger than this can flip the token."""
    top = sorted((x.logprob for x in logprobs.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else math.inf


def kernel_times(work: Callable[[], object]) -> dict[str, float]:
    """GPU time (µs) per kernel name while ``work`` runs, under torch's profiler (CUDA graphs'
    kernels included). The engine runs in this process, so its kernels are all seen."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.device_time_total
    return times


def rounds(runs: list[dict]) -> int:
    """Rounds run: one off process each."""
    return sum(r["mode"] == "off" for r in runs)


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """``"1000/1000:64,128/1024:64"`` -> [(prompt, output, requests), ...]."""
    cases = []
    for item in text.split(","):
        lengths, requests = item.split(":")
        prompt, output = lengths.split("/")
        cases.append((int(prompt), int(output), int(requests)))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    today = datetime.date.today().isoformat()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", help="default: the preset's (bf16; tiny: float32)")
    parser.add_argument("--cases", default="1000/1000:64,128/1024:64",
                        help="PROMPT/OUTPUT:REQUESTS, comma-separated")
    parser.add_argument("--latency", default="1,32", help="decode-latency batch sizes")
    parser.add_argument("--latency-lengths", default="128/256", help="PROMPT/OUTPUT")
    parser.add_argument("--rounds", type=int, default=2, help="processes per mode")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per process")
    parser.add_argument("--table", type=Path, help="MOETUNE_TABLE for lookup (default: the "
                        "plugin's pick for this GPU)")
    parser.add_argument("--attention", help="attention backend (default TRITON_ATTN on cuda)")
    parser.add_argument("--vllm-dummy-weights", action="store_true", help="vLLM's +-1e-3 "
                        "weights as they are (default: scaled, see scaled())")
    parser.add_argument("--deterministic", action="store_true", help="lookup processes serve "
                        "only winners whose bits repeat (MOETUNE_DETERMINISTIC=1)")
    parser.add_argument("--check-only", action="store_true", help="every process takes only "
                        "the greedy check (the token question in a few minutes)")
    parser.add_argument("--no-lookup", action="store_true", help="no lookup process: an off "
                        "process per round, to set vLLM's own run-to-run differences beside an "
                        "earlier lookup run")
    parser.add_argument("--eager", action="store_true", default=None,
                        help="enforce_eager instead of vLLM's default torch.compile and CUDA "
                        "graphs (default on the CPU)")
    parser.add_argument("--profile", action="store_true", help="the MoE share of GPU time from "
                        "a profile of a decode and a prefill window (CUDA)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--cpu-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--commit", help="default: git HEAD of this checkout")
    parser.add_argument("--out", type=Path, help="default bench/results/vllm-e2e-PRESET-DATE.md")
    parser.add_argument("--json", type=Path, help="every process's raw results (JSON lines)")
    parser.add_argument("--resume", action="store_true", help="add to the runs already in "
                        "--json (same arguments): rounds split over several calls")
    args = parser.parse_args()
    if args.resume and not args.json:
        parser.error("--resume needs --json")
    if args.no_lookup and not args.check_only:
        parser.error("--no-lookup has nothing to time against: add --check-only")
    args.dtype = args.dtype or PRESETS[args.preset][1]
    args.attention = args.attention or ("TRITON_ATTN" if args.device == "cuda" else None)
    args.eager = args.device == "cpu" if args.eager is None else args.eager
    if args.profile and args.device != "cuda":
        parser.error("--profile reads CUDA kernels' times")
    args.commit = args.commit or commit() or "unknown"
    args.out = args.out or ROOT / "bench" / "results" / f"vllm-e2e-{args.preset}-{today}.md"
    cases = parse_cases(args.cases)
    lat_prompt, lat_output = map(int, args.latency_lengths.split("/"))
    latency = [int(b) for b in args.latency.split(",")]
    args.max_model_len = max([p + o for p, o, _ in cases]
                             + [lat_prompt + lat_output, CHECK_PROMPT + CHECK_OUTPUT])
    runs = []
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)  # the engines' logs go beside it
    if args.resume and args.json.exists():
        runs = [json.loads(line) for line in args.json.read_text().splitlines() if line]
    done = rounds(runs)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = write_model(args.preset, work / "model", args.layers, args.dtype)
        spec = {"model": str(work / "model"), "device": args.device, "dtype": args.dtype,
                "cases": cases, "latency": latency,
                "eager": args.eager, "scaled_weights": not args.vllm_dummy_weights,
                "profile": args.profile, "check_only": args.check_only,
                "max_num_seqs": max([n for _, _, n in cases] + latency + [CHECK_REQUESTS]),
                "latency_lengths": [lat_prompt, lat_output], "repeats": args.repeats,
                "attention": args.attention, "max_model_len": args.max_model_len,
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "cpu_kv_gib": args.cpu_kv_gib, "vocab_size": config["vocab_size"]}
        (work / "spec.json").write_text(json.dumps(spec))
        offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        lookup = ({"MOETUNE_TABLE": str(args.table.resolve())} if args.table else {}) | (
            {"MOETUNE_DETERMINISTIC": "1"} if args.deterministic else {})
        for i in range(done, done + args.rounds):
            modes = [("off", {})] + [("lookup", lookup)] * (not args.no_lookup)
            random.Random(i).shuffle(modes)
            for mode, env in modes:
                out = work / f"{mode}-{i}.json"
                log = (args.json.parent if args.json else work) / f"{args.preset}-{mode}-{i}.log"
                print(f"round {i + 1}: MOETUNE_MODE={mode}", flush=True)
                runs.append(run_child(__file__, [str(work / "spec.json"), str(out)], out, log,
                                      MOETUNE_MODE=mode, **env, **offline))
                runs[-1]["plugin_log"] = [line for line in log.read_text().splitlines()
                                          if "[moetune]" in line][:PLUGIN_LINES]
                if args.json:
                    args.json.write_text("".join(json.dumps(r) + "\n" for r in runs))
    args.rounds = rounds(runs)
    text = report(args, config, runs, today)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
