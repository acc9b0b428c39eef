"""Does vLLM's vendored DeepGEMM load under this torch, and how long is its JIT's first call?

Prints one JSON object: the import time and version of ``vllm.third_party.deep_gemm`` (or the
error), ``vllm_deepgemm``'s verdict (the reason where it cannot run), and for DeepSeek-V3 TP8's
block-fp8 layer at ``--tokens``: the weight preparation (vLLM's, requantizing under E8M0), the
first call (DeepGEMM compiles its two GEMMs' kernels with nvcc), the second, and the error
against the float32 reference. Run it twice to see the JIT cache (``DG_JIT_CACHE_DIR``, set by
vLLM to ``~/.cache/vllm/deep_gemm``) make the first call fast.

    python3 scripts/probe_deepgemm.py [--tokens 256] > $OUT/deepgemm-probe.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    out: dict[str, object] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    start = time.perf_counter()
    try:
        import vllm.third_party.deep_gemm as dg

        out.update(import_s=time.perf_counter() - start, version=dg.__version__,
                   num_sms=dg.get_num_sms(),
                   alignment=dg.get_mk_alignment_for_contiguous_layout())
    except Exception as e:  # noqa: BLE001 - the point is to report it
        out["import_error"] = f"{type(e).__name__}: {e}"
    from moetune.runtime.registry import default_registry
    from moetune.runtime.vllm.deepgemm import vllm_deepgemm
    from moetune.tuner.gate import relative_error
    from moetune.tuner.inputs import make_batch, make_weights
    from moetune.tuner.presets import preset

    code, why = vllm_deepgemm()
    out["verdict"] = why or "runs"
    if code is not None:
        out["e8m0"] = bool(code.dg.is_deep_gemm_e8m0_used())
        problem = preset("deepseek-v3").shape.problem(args.tokens)
        weights = make_weights(problem, "cuda", seed=0)
        batch = make_batch(problem, "cuda", seed=1).args()
        start = time.perf_counter()
        fn = default_registry.get("vllm_deepgemm").prepare(problem, {}, weights)
        torch.cuda.synchronize()
        out["prepare_s"] = time.perf_counter() - start
        for call in ("first_call_s", "second_call_s"):
            start = time.perf_counter()
            got = fn(*batch)
            torch.cuda.synchronize()
            out[call] = time.perf_counter() - start
        want = default_registry.get("reference").prepare(problem, {}, weights)(*batch)
        out["relative_error"] = relative_error(got, want)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
