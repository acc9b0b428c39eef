"""moetune's own small-M (decode) MoE kernel: the whole layer in two Triton launches, no routing
step. One program per routed (token, slot) pair and tile: GEMM1 with the activation fused, then
GEMM2 with the weighted top-k reduce fused (``_decode`` holds the kernels and says how).

At 1-16 tokens the layer is a GEMV over the routed experts' weights, so what counts is reading
those weights at HBM speed with every SM busy: no align/sort, no activation quantization, no
separate activation or reduce launches. fp8 weights are dequantized in registers and the
activations stay in the compute dtype (W8A16), which is also more accurate than W8A8.
"""

from __future__ import annotations

from typing import Any, Callable

from moetune.runtime.kernels.base import MoEFn, MoEWeights, Param
from moetune.runtime.kernels._own_triton import OwnTritonKernel, atomic_order_reason
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.kernels.triton_config import operand_bytes, pdl_reason
from moetune.runtime.problem import DType, MoEProblem, QuantScheme

#: Routed pairs (num_tokens x topk) up to which the kernel is offered: one program per pair
#: reads its expert's rows on its own, so beyond decode sizes grouped GEMMs win.
MAX_PAIRS = 256
#: float32 accumulators per thread a tile may need (the 2-D accumulators of gate and up, or of
#: W2): more spill to local memory.
MAX_ACC_PER_THREAD = 64
#: How GEMM2's partial sums meet when there is something to reduce (top-k > 1 or split-K):
#: ``atomic`` adds into a float32 buffer then casts it (one torch copy); ``atomic_out`` adds into
#: the output itself (two launches in all; rounds each add to the output dtype); ``ordered``
#: stores each partial in its own row and sums the rows in a fixed order (deterministic).
REDUCES = ("atomic", "atomic_out", "ordered")
#: Whether GEMM2 launches while GEMM1 runs (programmatic dependent launch): at decode sizes
#: each launch is a few microseconds of ramp, and GEMM2's weight reads need nothing from GEMM1.
PDL = (0, 1)
#: The L2 prefetch of GEMM2's weight rows (``PDL``) moves whole 16-byte units.
PREFETCH_ALIGN = 16


class MoetuneDecodeKernel(OwnTritonKernel):
    """GEMV-like fused MoE for decode: ``g1_*`` tiles GEMM1 (+activation), ``g2_*`` GEMM2
    (+weighted reduce, optionally split over I)."""

    name = "moetune_decode"
    params = (
        # 1-2 rows: at 1-2 tokens of a top-1 layer (Llama-4: one expert, I = 1024) even
        # 4-row tiles leave fewer than two programs per SM.
        Param("g1_BLOCK_N", (1, 2, 4, 8, 16, 32, 64)),
        Param("g1_BLOCK_K", (64, 128, 256, 512, 1024)),
        Param("g1_num_warps", (2, 4, 8)),
        Param("g1_num_stages", (1, 2, 3)),
        Param("g2_BLOCK_N", (8, 16, 32, 64, 128)),
        Param("g2_BLOCK_K", (32, 64, 128, 256, 512)),
        Param("g2_num_warps", (2, 4, 8)),
        Param("g2_num_stages", (1, 2, 3)),
        Param("SPLIT_K", (1, 2, 4)),
        Param("REDUCE", REDUCES),
        Param("PDL", PDL, default=0),
    )
    kernels_module = "moetune.runtime.kernels._decode"
    #: A pair routed nowhere loops over nothing (``_decode``).
    skips_unrouted = True

    # --- eligibility -------------------------------------------------------------------------
    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        pairs = problem.num_tokens * problem.topk
        if pairs > MAX_PAIRS:
            return (f"num_tokens x topk = {pairs} > {MAX_PAIRS}: a decode kernel (one program "
                    "per routed pair, no expert grouping)")
        return super()._supports_problem(problem, sku)

    # --- parameters --------------------------------------------------------------------------
    @classmethod
    def check_params(cls, problem: MoEProblem, params: dict[str, Any]) -> str | None:
        h, i = problem.hidden_size, problem.intermediate_size
        halves = 2 if problem.gated else 1
        for gemm, n, k, tiles in (("g1", i, h, halves), ("g2", h, i, 1)):
            reason = tile_reason(problem, gemm, (f"{gemm}_BLOCK_N", f"{gemm}_BLOCK_K"), n, k,
                                 tiles, params[f"{gemm}_num_warps"], params, cls.choices)
            if reason:
                return reason
        split, reduce = params["SPLIT_K"], params["REDUCE"]
        if split > -(-i // params["g2_BLOCK_K"]):
            return (f"SPLIT_K={split} leaves splits of I={i} empty at "
                    f"g2_BLOCK_K={params['g2_BLOCK_K']}")
        if problem.topk == 1 and split == 1 and reduce != "atomic":
            return (f"top-1 without split-K stores its output directly: REDUCE={reduce} "
                    "changes nothing")
        if problem.dtype is DType.FLOAT32 and reduce == "atomic_out":
            return "float32 output: REDUCE=atomic already adds into the output"
        if params["PDL"]:
            reason = pdl_reason()
            if reason:
                return f"PDL=1: {reason}"
            if i * operand_bytes(problem) % PREFETCH_ALIGN:
                return (f"PDL=1: W2 rows of I={i} elements are not {PREFETCH_ALIGN}-byte aligned "
                        "for the L2 prefetch")
        return None

    @classmethod
    def run_to_run(cls, problem: MoEProblem, params: dict[str, Any]) -> str | None:
        """Each output row meets top-k x SPLIT_K partials by atomics unless ``REDUCE=ordered``."""
        return atomic_order_reason(params["REDUCE"], problem.topk * params["SPLIT_K"])

    @classmethod
    def seed_params(cls, problem: MoEProblem, sku: SKU) -> dict[str, Any] | None:
        """Tiles that give every SM two programs (rows no wider than 16 in GEMM1 and 64 in
        GEMM2), with K as long as the accumulators allow at 4 warps. On the CPU (the
        interpreter, whose cost is per program) the widest tiles."""
        pairs = problem.num_tokens * problem.topk
        gpu = sku.vendor is not Vendor.CPU
        programs = 2 * sku.compute_units if gpu else 1
        h, i = problem.hidden_size, problem.intermediate_size
        halves = 2 if problem.gated else 1
        longest = 512 if problem.quant.is_fp8 else 128 if problem.dtype is DType.FLOAT32 else 256
        limit = MAX_ACC_PER_THREAD * 32 * 4  # 4 warps

        def tile(n: int, k: int, ns: tuple[int, ...], ks: tuple[int, ...], parts: int,
                 widest: int) -> tuple[int, int]:
            fits = [b for b in ns if b <= max(min(widest, pow2(n)), ns[0])]
            block_n = next((b for b in reversed(fits) if pairs * -(-n // b) >= programs),
                           fits[0])
            ks = [b for b in ks if b <= max(min(longest, pow2(k)), ks[0])]
            block_k = next(b for b in reversed(ks) if parts * block_n * b <= limit or b == ks[0])
            return block_n, block_k

        n1, k1 = tile(i, h, cls.choices("g1_BLOCK_N"), cls.choices("g1_BLOCK_K"), halves,
                      16 if gpu else 64)
        n2, k2 = tile(h, i, cls.choices("g2_BLOCK_N"), cls.choices("g2_BLOCK_K"), 1,
                      64 if gpu else 128)
        seed = {"g1_BLOCK_N": n1, "g1_BLOCK_K": k1, "g1_num_warps": 4, "g1_num_stages": 2,
                "g2_BLOCK_N": n2, "g2_BLOCK_K": k2, "g2_num_warps": 4, "g2_num_stages": 2,
                "SPLIT_K": 1, "REDUCE": "atomic", "PDL": 0}
        return seed if cls.check_params(problem, seed) is None else None

    # --- execution ---------------------------------------------------------------------------
    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        from moetune.runtime.kernels._decode import launcher

        return launcher(problem, params, weights)


def tile_reason(problem: MoEProblem, label: str, names: tuple[str, str], n: int, k: int,
                tiles: int, num_warps: int, params: dict[str, Any],
                choices: Callable[[str], tuple[Any, ...]]) -> str | None:
    """Why one GEMV tile of a decode kernel (``names``: its BLOCK_N and BLOCK_K parameters, over
    ``n`` output rows and ``k`` deep; ``tiles`` float32 accumulator tiles: gate and up) should
    not run: accumulators that spill, a tile wider than the GEMM (a smaller one computes the
    same), or rows across two 128-row fp8 scale blocks. ``label`` names the GEMM."""
    (name_n, name_k), block_n, block_k = names, params[names[0]], params[names[1]]
    per_thread = tiles * block_n * block_k // (32 * num_warps)
    if per_thread > MAX_ACC_PER_THREAD:
        return (f"{label}: {per_thread} float32 accumulators per thread "
                f"(at most {MAX_ACC_PER_THREAD}: more spill)")
    for name, block, size in ((name_n, block_n, n), (name_k, block_k, k)):
        if block > max(pow2(size), choices(name)[0]):
            return f"{name}={block} exceeds {size} (a smaller tile computes the same)"
    if problem.quant is QuantScheme.FP8_BLOCK_128X128 and 128 % block_n:
        return f"{name_n}={block_n} spans two 128-row scale blocks"
    return None


def pow2(n: int) -> int:
    """The smallest power of two at least ``n``."""
    return 1 << (n - 1).bit_length()

