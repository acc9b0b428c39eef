"""Runs vLLM's real engine on a local model and writes what it generated as JSON.

Usage: ``python tests/vllm_driver.py MODEL_DIR OUT.json [--in-process] [--compile]
[--dtype DTYPE] [--quantization METHOD]``. The MOETUNE_* settings come from the environment.
vLLM spawns its engine core (and workers), which import this file again, so everything happens
under ``if __name__ == "__main__"``. ``--in-process`` keeps the engine and its worker in this
process (faster; the default runs vLLM's usual process layout); ``--compile`` lets vLLM
torch.compile the model (the default is ``enforce_eager``); ``--dtype`` is the activation dtype
(default float32); ``--quantization`` is passed to ``LLM(quantization=...)`` (e.g. ``fp8``:
vLLM quantizes the checkpoint's weights at load).
"""

from __future__ import annotations

import argparse
import json
import os
import time

#: Prompts of different lengths, so prefill and decode see different num_tokens.
PROMPTS = [[1, 5, 9, 22, 100, 7], [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46],
           [2, 71, 82], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]


def main(model: str, out: str, in_process: bool, compile_model: bool, dtype: str,
         quantization: str | None) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=not compile_model,
              max_model_len=256,
              gpu_memory_utilization=0.3, dtype=dtype, quantization=quantization, seed=0,
              distributed_executor_backend="uni" if in_process else None)
    ready = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False)
    done = time.perf_counter()
    from moetune import serving as moetune_vllm

    result = {
        "pid": os.getpid(),
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                     for o in outputs],
        # Each step's two likeliest tokens: a bf16 near-tie between them is not a kernel bug.
        "top2": [[{str(t): p.logprob for t, p in lp.items()} for lp in o.outputs[0].logprobs]
                 for o in outputs],
        "startup_s": ready - started,
        "generate_s": done - ready,
        "driver_stats": moetune_vllm.stats(),
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization")
    a = parser.parse_args()
    main(a.model, a.out, a.in_process, a.compile, a.dtype, a.quantization)
