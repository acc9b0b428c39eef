"""moetune_grouped's kernels compiled for sm_90 with Triton 3.6 on the CPU: GEMM2 with its
activation tiles gathered by pointers against loaded through TMA (``A_TMA``), per tile, over
four tiles and persistent, at DeepSeek-V3's block-fp8 tile and Qwen3-235B's bf16 tile; GEMM1
under block fp8 with and without its epilogue writing GEMM2's fp8 input (``FP8_OUT``). Prints
each kernel's size, registers, spills, shared memory and the instruction mix of its loops.

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



nodiv = ("pairs", "num_rows", "stride_wk", "stride_se", "stride_sn", "stride_sk", "stride_asm",
         "stride_xsm", "zero_rows", "zero_cols", "zero_stride", "stride_hsm")
for label, dtype, quant, bm, bn, bk, warps, stages in (
        ("deepseek-v3", "fp8e4nv", 3, 64, 128, 128, 4, 3), ("qwen3-235b", "bf16", 0, 128, 128, 64, 8, 3)):
    for a_tma in (0, 1):
        ptrs = {"a_ptr": f"*{dtype}", "as_ptr": "*fp32", "w_ptr": f"*{dtype}", "s_ptr": "*fp32",
                "tw_ptr": "*fp32", "out_ptr": "*bf16", "sorted_ptr": "*i32", "experts_ptr": "*i32",
                "post_ptr": "*i32", "w_desc": f"tensordesc<{dtype}[1, {bn}, {bk}]>",
                "a_desc": f"tensordesc<{dtype}[{bm}, {bk}]>" if a_tma else f"*{dtype}"}
        common = dict(TOPK=8, QUANT=quant, MUL_WEIGHT=True, MODE=1, BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_K=bk, GROUP_M=16, N_MAJOR=0, W_TMA=1, ONE_BLOCK=True, stride_wk=1,
                      A_TMA=a_tma)
        for tiles in (1, 4):
            report(f"{label}_gemm2_A_TMA{a_tma}_tiles{tiles}", compile_fn(
                _grouped._gemm2_reduce, ptrs, {**common, "N_TILES": tiles}, nodiv, warps, stages))
        report(f"{label}_gemm2_A_TMA{a_tma}_persistent", compile_fn(
            _grouped._gemm2_persistent, ptrs, {**common, "N_TILES": 1}, nodiv, warps, stages))
for bm, bn, warps, pair in ((64, 64, 4, 0), (64, 128, 8, 1), (64, 128, 8, 0), (16, 128, 4, 1)):
    for fp8_out in ((0, 1) if bn >= 128 else (0,)):
        ptrs = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                "tw_ptr": "*fp32", "h_ptr": "*fp8e4nv" if fp8_out else "*bf16", "hs_ptr": "*fp32",
                "sorted_ptr": "*i32", "experts_ptr": "*i32", "post_ptr": "*i32",
                "zero_ptr": "*bf16", "w_desc": (f"tensordesc<fp8e4nv[1, 2, {bn}, 128]>" if pair
                                               else f"tensordesc<fp8e4nv[1, {bn}, 128]>")}
        const = dict(TOPK=8, GATED=True, ACT=0, QUANT=3, ON_INPUT=False, BLOCK_M=bm, BLOCK_N=bn,
                     BLOCK_K=128, GROUP_M=16, W_TMA=1, ZERO=True, ONE_BLOCK=True, PAIR_TMA=pair,
                     SORTED=0, FP8_OUT=fp8_out, FP8_MAX=448.0, stride_wk=1)
        report(f"deepseek-v3_gemm1_{bm}x{bn}_w{warps}_PAIR{pair}_FP8_OUT{fp8_out}",
               compile_fn(_grouped._gemm1_act, ptrs, const, nodiv, warps, 3))
