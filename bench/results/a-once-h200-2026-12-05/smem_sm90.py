"""``g2_A_ONCE``'s shared-memory check against Triton 3.6's sm_90 compiles of GEMM2: for tiles
around the 227 KiB limit (bf16 at I = 192, block fp8 at I = 256), what the compiler allocates
and whether the check keeps the point. Prints one line per point and the disagreements.

Run: PYTHONPATH=<triton 3.6.0> python smem_sm90.py (the project importable)."""
import inspect
import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moetune.runtime.kernels import _grouped
from moetune.runtime.kernels.moetune_grouped import _a_once_reason
from moetune.runtime.kernels.triton_config import shared_memory_limit
from moetune.runtime.problem import MoEProblem

NODIV = ("pairs", "num_rows", "stride_wk", "stride_se", "stride_sn", "stride_sk", "stride_asm")


def shared(dtype, quant, inter, bm, bn, bk, warps, stages):
    ptrs = {"a_ptr": f"*{dtype}", "as_ptr": "*fp32", "w_ptr": f"*{dtype}", "s_ptr": "*fp32",
            "tw_ptr": "*fp32", "out_ptr": "*bf16", "sorted_ptr": "*i32", "experts_ptr": "*i32",
            "post_ptr": "*i32", "w_desc": f"tensordesc<{dtype}[1, {bn}, {bk}]>", "a_desc": f"*{dtype}"}
    const = dict(TOPK=8, QUANT=quant, MUL_WEIGHT=True, MODE=1, BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_K=bk, GROUP_M=16, N_MAJOR=0, W_TMA=1, ONE_BLOCK=True, stride_wk=1,
                 A_TMA=0, N_TILES=4, A_ONCE=1, K_STEPS=-(-inter // bk))
    sig, attrs = {}, {}
    for i, n in enumerate(inspect.signature(_grouped._gemm2_reduce.fn).parameters):
        if n in const:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = ptrs[n]
            if not ptrs[n].startswith("tensordesc"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "i32"
            if n not in NODIV:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=_grouped._gemm2_reduce, signature=sig, constexprs=const, attrs=attrs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=stages))
    except Exception as error:  # noqa: BLE001 - a point the compiler refuses
        return f"error {type(error).__name__}"
    return compiled.metadata.shared


limit = shared_memory_limit()
wrong = []
for (dtype, quant, inter, element, quant_name), bm, bn, bk, warps, stages in itertools.product(
        (("bf16", 0, 192, 2, "none"), ("fp8e4nv", 3, 256, 1, "fp8_block_128x128")),
        (32, 64, 128, 256), (64, 128, 256), (64, 128, 256), (4, 8), (2, 3, 4)):
    if -(-inter // bk) > 2 or (quant == 3 and bk > 128):
        continue
    problem = MoEProblem(4096, 7168 if quant else 4096, inter, 256 if quant else 128, 8,
                         quant=quant_name)
    params = {"g2_N_TILES": 4, "g2_PERSISTENT": 0, "g2_BLOCK_SIZE_M": bm, "g2_BLOCK_SIZE_N": bn,
              "g2_BLOCK_SIZE_K": bk, "g2_num_stages": stages}
    kept = _a_once_reason(problem, params, element) is None
    estimate = element * -(-inter // bk) * bk * (bm + stages * bn) + 2 * bm * bn
    if not 0.7 * limit < estimate < 1.4 * limit:
        continue
    got = shared(dtype, quant, inter, bm, bn, bk, warps, stages)
    fits = isinstance(got, int) and got <= limit
    print(dtype, bm, bn, bk, warps, stages, "estimate", estimate, "compiled", got,
          "kept" if kept else "dropped", "" if kept == fits else "DISAGREES")
    if kept != fits:
        wrong.append((dtype, bm, bn, bk, warps, stages))
print(f"{len(wrong)} disagreements", wrong)
