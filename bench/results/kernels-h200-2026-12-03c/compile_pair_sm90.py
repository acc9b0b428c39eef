"""GEMM1's K loop compiled for sm_90 (Triton 3.6.0 and its ptxas, no GPU) at Qwen3-30B-A3B
4096's tile (128 rows, 128 columns each of gate and up, K steps of 64, 8 warps, 4 stages):
moetune_grouped with two TMA loads and two dots per step (g1_PAIR_TMA=0), with one 4-D box and
one dot (g1_PAIR_TMA=1), and aiter's fused-SiLU kernel. Prints the instructions of the loop
that holds the wgmma ops, and its barriers, TMA and cp.async ops.

Run: PYTHONPATH=<triton 3.6.0> python compile_pair_sm90.py (the project importable)."""
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
    for i, line in enumerate(lines):
        t = re.search(r"BRA .*?0x([0-9a-f]+)", line)
        if not t or int(t.group(1), 16) >= addr[i] or int(t.group(1), 16) not in addr:
            continue
        body = lines[addr.index(int(t.group(1), 16)):i + 1]
        if any("HGMMA" in b for b in body) and len(body) < 400:
            ops = collections.Counter(
                re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", b).group(1) for b in body)
            hgmma = sorted({re.search(r"HGMMA\.(\w+)", b).group(1) for b in body if "HGMMA" in b})
            print(f"{name}: shared {compiled.metadata.shared} B; K loop {len(body)} instructions: "
                  f"HGMMA {ops['HGMMA']} ({', '.join(hgmma)}), BAR {ops['BAR']}, "
                  f"UTMALDG {ops['UTMALDG']}, LDGSTS {ops['LDGSTS']}, SYNCS {ops['SYNCS']}, "
                  f"WARPGROUP {ops['WARPGROUP']}")


base = {"x_ptr": "*bf16", "xs_ptr": "*fp32", "w_ptr": "*bf16", "s_ptr": "*fp32",
        "tw_ptr": "*fp32", "h_ptr": "*bf16", "sorted_ptr": "*i32", "experts_ptr": "*i32",
        "post_ptr": "*i32", "zero_ptr": "*bf16"}
for pair, desc in ((0, "tensordesc<bf16[1, 128, 64]>"), (1, "tensordesc<bf16[1, 2, 128, 64]>")):
    const = dict(TOPK=8, GATED=True, ACT=0, QUANT=0, ON_INPUT=False, BLOCK_M=128, BLOCK_N=128,
                 BLOCK_K=64, GROUP_M=1, W_TMA=1, ZERO=True, ONE_BLOCK=False, PAIR_TMA=pair,
                 stride_wk=1)
    loop_report(f"moetune_grouped_PAIR_TMA{pair}",
                compile_fn(_grouped._gemm1_act, {**base, "w_desc": desc}, const,
                           ("zero_rows", "pairs", "num_rows", "stride_wk", "stride_se",
                            "stride_sn", "stride_sk")))

fn = aiter_loader.load("silu_fused").module._fused_moe_silu_kernel
while not isinstance(fn, triton.runtime.jit.JITFunction):
    fn = fn.fn
ptrs = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "a_scale_ptr": "*fp32",
        "b_scale_ptr": "*fp32", "topk_weights_ptr": "*fp32", "sorted_token_ids_ptr": "*i32",
        "expert_ids_ptr": "*i32", "num_tokens_post_padded_ptr": "*i32"}
names = list(inspect.signature(fn.fn).parameters)
const = dict(group_n=0, group_k=0, BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64,
             GROUP_SIZE_M=1, EVEN_K=True, MUL_ROUTED_WEIGHT=False, top_k=8,
             compute_type=tl.bfloat16, use_fp8_w8a8=False, use_int8_w8a16=False, NUM_XCDS=1,
             stride_ak=1, stride_bk=1, stride_cn=1)
loop_report("aiter_silu_fused", compile_fn(
    fn, ptrs, {k: v for k, v in const.items() if k in names},
    ("num_valid_tokens", "stride_ak", "stride_bk", "stride_cn", "stride_ask", "stride_bsk",
     "stride_bsn", "stride_bse", "stride_asm")))
