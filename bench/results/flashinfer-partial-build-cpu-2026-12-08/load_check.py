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
for name, act, weight, block in (("bf16", torch.bfloat16, torch.bfloat16, False),
                                 ("fp16", torch.float16, torch.float16, False),
                                 ("block fp8", torch.bfloat16, torch.float8_e4m3fn, True)):
    try:
        module.MoERunner(act, weight, act, 8, 1, 0, 1, 0, 1, 0, False, block,
                         False, False, False, False, ActivationType.Swiglu, False, True, False)
        print(name, "runner constructed")
    except RuntimeError as e:
        print(name, "runner raised:", str(e).splitlines()[0])

# Control, in a process of its own: a runner of a dtype left out (fp8 activations and weights,
# per-tensor) reaches a stub, which names itself and aborts.
if __import__("sys").argv[1:] == ["control"]:
    module.MoERunner(torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16, 8, 1, 0, 1, 0, 1, 0,
                     False, False, False, False, False, False, ActivationType.Swiglu, False, True,
                     False)
