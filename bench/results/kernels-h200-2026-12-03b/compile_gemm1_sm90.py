"""Compile moetune's GEMM1 and aiter's fused-SiLU GEMM1 for sm_90 at Qwen3-30B-A3B 4096's
config (M128 N256(gate+up) K64, 8 warps, 4 stages) and print resource use and loop stats."""
import inspect, re, sys, subprocess, os, collections
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile_fn(fn, ptrs, const, nodiv=(), opts=None):
    names = list(inspect.signature(fn.fn).parameters)
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in const: sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = ptrs[n]
            if not ptrs[n].startswith("tensordesc"): attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "i32"
            if n not in nodiv: attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)

def stats(name, c):
    sass = c.asm.get("sass") or ""
    ttgir = c.asm["ttgir"]
    ptx = c.asm["ptx"]
    md = c.metadata
    print(f"== {name}: shared {md.shared} B, num_warps {md.num_warps}")
    print("  ttgir: wgmma", ttgir.count("warp_group_dot "), "async_copy", ttgir.count("async_copy_global_to_local"),
          "tma", ttgir.count("async_tma_copy"), "convert_layout", ttgir.count("convert_layout"), "local_alloc", ttgir.count("local_alloc"))
    print("  ptx: wgmma.mma_async", ptx.count("wgmma.mma_async"), "cp.async", ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
          "setp", ptx.count("setp."), "lines", ptx.count("\n"))
    m = re.search(r"\.maxnreg (\d+)", ptx)
    open(f"/tmp/{name}.ptx", "w").write(ptx); open(f"/tmp/{name}.ttgir", "w").write(ttgir)
    cubin = c.asm["cubin"]; open(f"/tmp/{name}.cubin", "wb").write(cubin)
    bin = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    out = subprocess.run([f"{bin}/cuobjdump", "-res-usage", f"/tmp/{name}.cubin"], capture_output=True, text=True).stdout
    print("  ", " ".join(l.strip() for l in out.splitlines() if "REG" in l))

# moetune and aiter from the project venv; Triton 3.6.0 (the H200 run's) first on PYTHONPATH
from moetune.runtime.kernels import _grouped as g
elem = "bf16"
ptrs = {"x_ptr": "*bf16", "xs_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "tw_ptr": "*fp32",
        "h_ptr": "*bf16", "sorted_ptr": "*i32", "experts_ptr": "*i32", "post_ptr": "*i32", "zero_ptr": "*bf16",
        "w_desc": "tensordesc<bf16[1, 128, 64]>"}
for tma in (0, 1):
    p = dict(ptrs)
    if not tma: p["w_desc"] = "*bf16"
    const = dict(TOPK=8, GATED=True, ACT=0, QUANT=0, ON_INPUT=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                 GROUP_M=16, W_TMA=tma, ZERO=True, ONE_BLOCK=False, stride_wk=1)
    try:
        c = compile_fn(g._gemm1_act, p, const, nodiv=("zero_rows", "pairs", "num_rows", "stride_wk", "stride_se", "stride_sn", "stride_sk"),
                       opts=dict(num_warps=8, num_stages=4))
        stats(f"moetune_tma{tma}", c)
    except Exception as e:
        print("moetune", tma, "failed", type(e).__name__, str(e)[:500])
from moetune.runtime import aiter_loader
mod = aiter_loader.load("silu_fused")
print(mod.reason)
fn = mod.module._fused_moe_silu_kernel
while not hasattr(fn, "fn") or not isinstance(fn, triton.runtime.jit.JITFunction):
    fn = fn.fn
import triton.language as tl
ptrs = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
        "topk_weights_ptr": "*fp32", "sorted_token_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "num_tokens_post_padded_ptr": "*i32"}
const = dict(group_n=0, group_k=0, BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=16, EVEN_K=True,
             MUL_ROUTED_WEIGHT=False, top_k=8, compute_type=tl.bfloat16, use_fp8_w8a8=False, use_int8_w8a16=False, NUM_XCDS=1, stride_ak=1, stride_bk=1, stride_cn=1)
names = list(inspect.signature(fn.fn).parameters)
const = {k: v for k, v in const.items() if k in names}
c = compile_fn(fn, ptrs, const, nodiv=("num_valid_tokens", "stride_ak", "stride_bk", "stride_cn", "stride_ask", "stride_bsk", "stride_bsn", "stride_bse", "stride_asm"),
               opts=dict(num_warps=8, num_stages=4))
stats("aiter_silu", c)
fn = mod.module._fused_moe_persistent_silu_kernel
while not isinstance(fn, triton.runtime.jit.JITFunction):
    fn = fn.fn
names = list(inspect.signature(fn.fn).parameters)
print([n for n in names if n not in ptrs])
const2 = dict(const, NUM_SMS=132)
const2 = {k: v for k, v in const2.items() if k in names}
c = compile_fn(fn, ptrs, const2, nodiv=("num_valid_tokens", "stride_ak", "stride_bk", "stride_cn", "stride_ask", "stride_bsk", "stride_bsn", "stride_bse", "stride_asm"),
               opts=dict(num_warps=8, num_stages=4))
stats("aiter_silu_persistent", c)
