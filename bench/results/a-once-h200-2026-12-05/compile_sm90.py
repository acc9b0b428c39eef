"""GEMM2 of moetune_grouped compiled for sm_90 with Triton 3.6 on the CPU, with its activation
rows loaded per tile (``A_ONCE=0``) and once per program (``A_ONCE=1``), at DeepSeek-V3's
block-fp8 row (64 x 128 tiles, four per program) and Qwen3-235B's bf16 tiles. Prints each
kernel's size, registers, spills, shared memory and the instruction mix of its loops.

Run: PYTHONPATH=<triton 3.6.0> python compile_sm90.py (the project importable)."""
import collections
import inspect
import os
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moetune.runtime.kernels import _grouped

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def compile_fn(fn, ptrs, const, nodiv, num_warps, num_stages):
    sig, attrs = {}, {}
    for i, n in enumerate(inspect.signature(fn.fn).parameters):
        if n in const:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = ptrs[n]
            if not ptrs[n].startswith("tensordesc"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "i32"
            if n not in nodiv:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def report(name, compiled):
    path = f"/tmp/{name}.cubin"
    open(path, "wb").write(compiled.asm["cubin"])
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", path], capture_output=True,
                          text=True).stdout
    lines = [l for l in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", l)]
    addr = [int(re.match(r"\s*/\*([0-9a-f]+)\*/", l).group(1), 16) for l in lines]
    usage = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", path], capture_output=True,
                           text=True).stdout
    resources = re.search(r"REG:\d+ STACK:\d+", usage).group(0)
    ttgir = compiled.asm["ttgir"]
    print(f"{name}: {len(lines)} instructions; {resources}; shared {compiled.metadata.shared} B; "
          f"ttgir async_copy {ttgir.count('async_copy_global_to_local')}, "
          f"TMA loads {ttgir.count('async_tma_copy_global_to_local')}, "
          f"wait {ttgir.count('async_wait')}, barrier waits {ttgir.count('wait_barrier')}")
    for i, line in enumerate(lines):
        t = re.search(r"BRA .*?0x([0-9a-f]+)", line)
        if not t or int(t.group(1), 16) >= addr[i] or int(t.group(1), 16) not in addr:
            continue
        body = lines[addr.index(int(t.group(1), 16)):i + 1]
        if any("GMMA" in b for b in body) and len(body) < 1500:
            ops = collections.Counter(
                re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", b).group(1) for b in body)
            print(f"  loop of {len(body)} instructions: GMMA {ops['HGMMA'] + ops['QGMMA']}, "
                  f"UTMALDG {ops['UTMALDG']}, LDGSTS {ops['LDGSTS']}, RED {ops['RED'] + ops['REDG']}, "
                  f"BAR {ops['BAR']}, SYNCS {ops['SYNCS']}, LDG {ops['LDG']}")




nodiv = ("pairs", "num_rows", "stride_wk", "stride_se", "stride_sn", "stride_sk", "stride_asm")
for label, dtype, quant, bm, bn, bk, tiles, warps, stages, a_tma in (
        ("deepseek-v3", "fp8e4nv", 3, 64, 128, 128, 4, 4, 3, 1),
        ("deepseek-v3", "fp8e4nv", 3, 128, 128, 128, 8, 8, 2, 0),
        ("qwen3-235b", "bf16", 0, 64, 128, 128, 8, 4, 3, 0),
        ("qwen3-235b", "bf16", 0, 128, 128, 128, 8, 8, 2, 0),
        ("qwen3-235b", "bf16", 0, 64, 128, 256, 8, 4, 2, 0)):
    for a_once in (0, 1):
        ptrs = {"a_ptr": f"*{dtype}", "as_ptr": "*fp32", "w_ptr": f"*{dtype}", "s_ptr": "*fp32",
                "tw_ptr": "*fp32", "out_ptr": "*bf16", "sorted_ptr": "*i32", "experts_ptr": "*i32",
                "post_ptr": "*i32", "w_desc": f"tensordesc<{dtype}[1, {bn}, {bk}]>",
                "a_desc": f"tensordesc<{dtype}[{bm}, {bk}]>" if a_tma else f"*{dtype}"}
        const = dict(TOPK=8, QUANT=quant, MUL_WEIGHT=True, MODE=1, BLOCK_M=bm, BLOCK_N=bn,
                     BLOCK_K=bk, GROUP_M=16, N_MAJOR=1, W_TMA=1, ONE_BLOCK=True, stride_wk=1,
                     A_TMA=a_tma, N_TILES=tiles, A_ONCE=a_once,
                     K_STEPS=(-(-(256 if quant else 192) // bk)) if a_once else 0)
        report(f"{label}_{bm}x{bn}x{bk}_tiles{tiles}_w{warps}_s{stages}_A_TMA{a_tma}_A_ONCE{a_once}",
               compile_fn(_grouped._gemm2_reduce, ptrs, const, nodiv, warps, stages))
