"""moetune's one-launch decode kernel: the whole MoE layer (both GEMMs, the activation, the
weighted top-k sum and the cast to the output dtype) in one persistent Triton launch.

At 1-8 tokens of many-expert models the two launches of ``moetune_decode`` (and any glue) leave
gaps of a few microseconds each, against a 10-30 us layer. Here a fixed grid of programs, all
resident, computes GEMM1 tiles, then GEMM2 tiles that wait only for their own routed pair's
intermediate row (``_one_launch`` says how, and why the reduce is ordered). fp8 weights are
dequantized in registers (W8A16), as in ``moetune_decode``.
"""

from __future__ import annotations

from typing import Any

from moetune.runtime.kernels._own_triton import OwnTritonKernel
from moetune.runtime.kernels.base import MoEFn, MoEWeights, Param
from moetune.runtime.kernels.moetune_decode import MAX_ACC_PER_THREAD, pow2, tile_reason
from moetune.runtime.platform import SKU, Vendor, detect_sku
from moetune.runtime.problem import DType, MoEProblem

#: Routed pairs (num_tokens x topk) up to which it is offered: 8 tokens of a top-8 layer. The
#: counters are sized for them, and beyond, GEMM1's pairs re-read shared experts' rows (no
#: expert grouping) and the launch gap it saves is a smaller share of the layer.
MAX_PAIRS = 64


class MoetuneDecodeOneKernel(OwnTritonKernel):
    """Persistent fused MoE for decode: ``*1`` tiles GEMM1 (+activation), ``*2`` GEMM2
    (+weighted ordered reduce); ``PROGRAMS_PER_SM`` sizes the grid (capped at what is resident)."""

    name = "moetune_decode_one"
    deterministic = True  # partials summed in a fixed order (``_one_launch``)
    params = (
        Param("BLOCK_N1", (1, 2, 4, 8, 16, 32)),
        Param("BLOCK_K1", (64, 128, 256, 512, 1024)),
        Param("BLOCK_N2", (4, 8, 16, 32, 64, 128)),
        Param("BLOCK_K2", (32, 64, 128, 256, 512)),
        Param("num_warps", (2, 4, 8)),
        Param("num_stages", (1, 2, 3)),
        Param("PROGRAMS_PER_SM", (1, 2, 3, 4)),
    )
    kernels_module = "moetune.runtime.kernels._one_launch"
    #: A pair routed nowhere loops over nothing and still completes its counters
    #: (``_one_launch``).
    skips_unrouted = True

    # --- eligibility -------------------------------------------------------------------------
    @classmethod
    def _supports_problem(cls, problem: MoEProblem, sku: SKU) -> str | None:
        pairs = problem.num_tokens * problem.topk
        if pairs > MAX_PAIRS:
            return (f"num_tokens x topk = {pairs} > {MAX_PAIRS}: a one-launch decode kernel "
                    "(counters for at most 8 tokens of top-8)")
        return super()._supports_problem(problem, sku)

    # --- parameters --------------------------------------------------------------------------
    @classmethod
    def check_params(cls, problem: MoEProblem, params: dict[str, Any]) -> str | None:
        h, i = problem.hidden_size, problem.intermediate_size
        halves = 2 if problem.gated else 1
        for gemm, n, k, tiles in (("1", i, h, halves), ("2", h, i, 1)):
            reason = tile_reason(problem, f"GEMM{gemm}", (f"BLOCK_N{gemm}", f"BLOCK_K{gemm}"),
                                 n, k, tiles, params["num_warps"], params, cls.choices)
            if reason:
                return reason
        return None

    @classmethod
    def seed_params(cls, problem: MoEProblem, sku: SKU) -> dict[str, Any] | None:
        """Two programs per SM at 4 warps; the widest row tiles that still give every program
        an item of each GEMM, K as long as the accumulators allow. On the CPU (the interpreter,
        whose cost is per item) the widest tiles and two programs."""
        gpu = sku.vendor is not Vendor.CPU
        programs = 2 * sku.compute_units if gpu else 1
        pairs = problem.num_tokens * problem.topk
        h, i = problem.hidden_size, problem.intermediate_size
        halves = 2 if problem.gated else 1
        longest = 512 if problem.quant.is_fp8 else 128 if problem.dtype is DType.FLOAT32 else 256
        limit = MAX_ACC_PER_THREAD * 32 * 4  # 4 warps

        def tile(n: int, k: int, gemm: str, parts: int, widest: int) -> tuple[int, int]:
            ns, ks = cls.choices(f"BLOCK_N{gemm}"), cls.choices(f"BLOCK_K{gemm}")
            fits = [b for b in ns if b <= max(min(widest, pow2(n)), ns[0])]
            block_n = next((b for b in reversed(fits) if pairs * -(-n // b) >= programs),
                           fits[0])
            ks = [b for b in ks if b <= max(min(longest, pow2(k)), ks[0])]
            block_k = next(b for b in reversed(ks) if parts * block_n * b <= limit or b == ks[0])
            return block_n, block_k

        n1, k1 = tile(i, h, "1", halves, 16 if gpu else 32)
        n2, k2 = tile(h, i, "2", 1, 64 if gpu else 128)
        seed = {"BLOCK_N1": n1, "BLOCK_K1": k1, "BLOCK_N2": n2, "BLOCK_K2": k2,
                "num_warps": 4, "num_stages": 2, "PROGRAMS_PER_SM": 2}
        return seed if cls.check_params(problem, seed) is None else None

    # --- execution ---------------------------------------------------------------------------
    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        from moetune.runtime.kernels._one_launch import launcher

        device = weights.w13.device
        sm_count = detect_sku(str(device)).compute_units if device.type == "cuda" else 1
        return launcher(problem, params, weights, sm_count)

