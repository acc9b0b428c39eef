"""The kept module loaded through FlashInfer's AOT path, then each runner constructed."""
import time
from pathlib import Path

import torch
from flashinfer.fused_moe import ActivationType
from flashinfer.fused_moe.core import get_cutlass_fused_moe_module
from flashinfer.jit import env

print("AOT artifacts:", sorted(str(p) for p in env.FLASHINFER_AOT_DIR.glob("fused_moe_*/*.so")))
start = time.perf_counter()
module = get_cutlass_fused_moe_module("90")
print(f"loaded in {time.perf_counter() - start:.2f} s:", [a for a in dir(module) if not a.startswith("_")])
print("objects or modules in the JIT workspace:", sum(1 for p in Path("/tmp/fi-load-ws").rglob("*") if p.suffix in (".o", ".so")))
for name, weight, block in (("bf16", torch.bfloat16, False), ("block fp8", torch.float8_e4m3fn, True)):
    try:
        module.MoERunner(torch.bfloat16, weight, torch.bfloat16, 8, 1, 0, 1, 0, 1, 0, False, block,
                         False, False, False, False, ActivationType.Swiglu, False, True, False)
        print(name, "runner constructed")
    except RuntimeError as e:
        print(name, "runner raised:", str(e).splitlines()[0])
