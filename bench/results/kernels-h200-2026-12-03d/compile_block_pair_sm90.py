"""Block-fp8 GEMM1 K loops compiled for sm_90 (Triton 3.6.0 and its ptxas, no GPU) at
DeepSeek-V3-sized tiles (K steps of 128, one scale block): moetune_grouped with two TMA loads
and two dots per step (g1_PAIR_TMA=0) and with one 4-D box and one dot (g1_PAIR_TMA=1). Prints
the instructions of the loop that holds the wgmma ops, its barriers and TMA ops, and the
kernel's registers and spills.

Run: PYTHONPATH=<triton 3.6.0> python compile_block_pair_sm90.py (the project importable)."""
import collections
import inspect
import os
import re
import subprocess

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moetune.runtime import aiter_loader
from moetune.runtime.kernels import _grouped

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def compile_fn(fn, ptrs, const, nodiv, num_warps=8, num_stages=4):
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


def loop_report(name, compiled):
    path = f"/tmp/{name}.cubin"
    open(path, "wb").write(compiled.asm["cubin"])
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", path], capture_output=True,
                          text=True).stdout
    lines = [l for l in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", l)]
    addr = [int(re.match(r"\s*/\*([0-9a-f]+)\*/", l).group(1), 16) for l in lines]
    usage = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", path], capture_output=True,
                           text=True).stdout
    resources = re.search(r"REG:\d+ STACK:\d+", usage).group(0)
    print(f"{name}: {len(lines)} instructions; {resources}")
    for i, line in enumerate(lines):
        t = re.search(r"BRA .*?0x([0-9a-f]+)", line)
        if not t or int(t.group(1), 16) >= addr[i] or int(t.group(1), 16) not in addr:
            continue
        body = lines[addr.index(int(t.group(1), 16)):i + 1]
        if any("GMMA" in b for b in body) and len(body) < 400:
            ops = collections.Counter(
                re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", b).group(1) for b in body)
            gmma = sorted({re.search(r"GMMA\.(\w+)", b).group(1) for b in body if "GMMA" in b})
            print(f"{name}: shared {compiled.metadata.shared} B; K loop {len(body)} instructions: "
                  f"QGMMA {ops['QGMMA']} ({', '.join(gmma)}), FFMA {ops['FFMA']}, FMUL {ops['FMUL']}, "
                  f"FSEL {ops['FSEL']}, SHFL {ops['SHFL']}, BAR {ops['BAR']}, "
                  f"UTMALDG {ops['UTMALDG']}, LDGSTS {ops['LDGSTS']}, SYNCS {ops['SYNCS']}, "
                  f"WARPGROUP {ops['WARPGROUP']}")


base = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
        "tw_ptr": "*fp32", "h_ptr": "*bf16", "sorted_ptr": "*i32", "experts_ptr": "*i32",
        "post_ptr": "*i32", "zero_ptr": "*bf16"}
nodiv = ("zero_rows", "pairs", "num_rows", "stride_wk", "stride_se", "stride_sn", "stride_sk",
         "stride_xsm")
for block_m, block_n, warps, stages in ((64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3),
                                        (64, 128, 4, 3)):
    for pair in (0, 1):
        shape = f"[1, 2, {block_n}, 128]" if pair else f"[1, {block_n}, 128]"
        const = dict(TOPK=8, GATED=True, ACT=0, QUANT=3, ON_INPUT=False, BLOCK_M=block_m,
                     BLOCK_N=block_n, BLOCK_K=128, GROUP_M=32, W_TMA=1, ZERO=True,
                     ONE_BLOCK=True, PAIR_TMA=pair, stride_wk=1)
        loop_report(f"block_fp8_{block_m}x{block_n}_w{warps}_PAIR_TMA{pair}",
                    compile_fn(_grouped._gemm1_act, {**base, "w_desc": f"tensordesc<fp8e4nv{shape}>"},
                               const, nodiv, num_warps=warps, num_stages=stages))
