"""Does FlashInfer's CUTLASS fused MoE build and run here, and what do its import, its JIT build
and its first calls cost?

``--build`` imports FlashInfer and builds its fused MoE module for this device, or loads it once
built (``fused_moe_90`` on Hopper: 248 compile units, which may outlast a 10-minute command, so
``scripts/device_flashinfer.sh`` runs this in the background). Without it: the import time,
``flashinfer_cutlass``'s verdict and, per preset (DeepSeek-V3 TP8's block-fp8 layer and Qwen3-30B's
bf16 one by default) at ``--tokens``: the weight preparation, the first call (the module's load,
the autotune of its tactics as vLLM's warm-up runs it, and, for block fp8, the NVRTC compile of
its GEMMs), the second, and the error against the float32 reference. Prints one JSON object.

    python3 scripts/probe_flashinfer.py --build > build.json
    python3 scripts/probe_flashinfer.py [--presets deepseek-v3,qwen3-30b-a3b] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def build() -> dict[str, Any]:
    """Import time, then the time to build (or load) the module ``cutlass_fused_moe`` calls;
    ``prebuilt`` says whether it was there as an AOT artifact (``scripts/flashinfer_module.sh
    restore``), so ``build_s`` is a load, not a build."""
    start = time.perf_counter()
    from flashinfer.fused_moe.core import get_cutlass_fused_moe_module
    from flashinfer.jit import env

    out: dict[str, Any] = {"import_s": time.perf_counter() - start,
                           "prebuilt": any(env.FLASHINFER_AOT_DIR.glob("fused_moe_*/*.so"))}
    major, minor = torch.cuda.get_device_capability()
    out["module_arch"] = f"{major * 10 + minor}"  # as cutlass_fused_moe names it
    start = time.perf_counter()
    get_cutlass_fused_moe_module(out["module_arch"])
    out["build_s"] = time.perf_counter() - start
    return out


def calls(presets: list[str], tokens: int) -> dict[str, Any]:
    """Import time, the kernel's verdict, and its first and second calls per preset."""
    start = time.perf_counter()
    import flashinfer

    out: dict[str, Any] = {"import_s": time.perf_counter() - start,
                           "version": flashinfer.__version__}
    from moetune.runtime.platform import detect_sku
    from moetune.runtime.registry import default_registry
    from moetune.tuner.gate import relative_error, tolerance
    from moetune.tuner.inputs import make_batch, make_weights
    from moetune.tuner.presets import preset

    kernel = default_registry.get("flashinfer_cutlass")
    sku = detect_sku("cuda")
    for name in presets:
        problem = preset(name).shape.problem(tokens)
        ok, why = kernel.supports(problem, sku)
        record: dict[str, Any] = {"verdict": why or "runs"}
        out[name] = record
        if not ok:
            continue
        try:
            weights = make_weights(problem, "cuda", seed=0)
            batch = make_batch(problem, "cuda", seed=1).args()
            start = time.perf_counter()
            fn = kernel.prepare(problem, {}, weights)
            torch.cuda.synchronize()
            record["prepare_s"] = time.perf_counter() - start
            for call in ("first_call_s", "second_call_s"):
                start = time.perf_counter()
                got = fn(*batch)
                torch.cuda.synchronize()
                record[call] = time.perf_counter() - start
            want = default_registry.get("reference").prepare(problem, {}, weights)(*batch)
            record["relative_error"] = relative_error(got, want)
            record["tolerance"] = tolerance(problem)
        except Exception as e:  # noqa: BLE001 - the point is to report it
            record["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="store_true")
    parser.add_argument("--presets", default="deepseek-v3,qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    out.update(build() if args.build else calls(args.presets.split(","), args.tokens))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
