"""moetune's own prefill MoE kernel: two grouped GEMMs over pairs sorted by expert, the gated
activation fused into the first and the weighted top-k reduce fused into the second
(``_grouped`` holds the kernels and says how).

vLLM's Triton path writes GEMM2's (M * topk, H) rows and sums them in another launch: at 2048
tokens of a top-8 layer with H = 4096 that is 268 MB written and read again for a 16 MB
result. Here each row is added into its token's output row as GEMM2 produces it (atomics into a
float32 buffer, or into the output itself), and the search also measures vLLM's way
(``REDUCE=sum``) so it keeps the fusion only where it pays.
"""

from __future__ import annotations

from typing import Any

from moetune.runtime.kernels.base import MoEFn, MoEWeights, Param
from moetune.runtime.kernels._own_triton import OwnTritonKernel, atomic_order_reason
from moetune.runtime.kernels.triton_config import (
    QUANT_BLOCK, config_of, config_params, operand_bytes, shared_memory_bytes,
    shared_memory_limit, tma_reason, vllm_config, with_prefix)
from moetune.runtime.platform import SKU
from moetune.runtime.problem import DType, MoEProblem, QuantScheme

#: Where GEMM2's rows meet: ``atomic`` adds them into a float32 buffer then casts it (one torch
#: copy); ``atomic_out`` adds into the output itself (each add rounds to the output dtype);
#: ``sum`` stores the (pairs, H) rows and sums them with torch, as vLLM does.
REDUCES = ("atomic", "atomic_out", "sum")
#: ``tl.dot`` needs tiles of at least 16 rows.
MIN_BLOCK_M = 16
#: Whether both GEMMs load their weight tiles through TMA descriptors (Hopper's tensor memory
#: accelerator: no address arithmetic or registers per tile) or by pointers, which every GPU
#: runs; activations are gathered by routed pair, which a descriptor cannot load on sm_90.
W_TMA = (0, 1)
#: A TMA descriptor's row strides must be multiples of this many bytes.
TMA_ALIGN = 16
#: Whether GEMM1 loads each K step's gate and up weight tiles in one TMA box and multiplies them
#: in one ``tl.dot`` twice as wide (``_grouped._gate_up_pairs``), instead of two loads and two
#: dots, each one more CTA barrier per K step on Hopper.
PAIR_TMA = (0, 1)
#: Tiles of H one GEMM2 program computes in one pipelined loop (``_grouped``); 1 was the only
#: value before this parameter existed.
N_TILES = (1, 2, 4, 8)
#: The order of GEMM2's programs: 0 takes ``g2_GROUP_SIZE_M`` blocks of pairs at a time across
#: all of H (vLLM's order); 1 takes every block for one group of columns before the next
#: (``g2_GROUP_SIZE_M`` then unused), so the output columns the fused reduce adds a token's
#: top-k rows into stay in L2 between them, where (tokens, H) is larger than L2.
N_MAJOR = (0, 1)
#: GEMM2 programs per SM on a fixed (persistent) grid, each walking units of ``g2_N_TILES``
#: tiles in one flattened loop (``_grouped._gemm2_persistent``) so the next tile's loads overlap
#: this tile's short K loop and epilogue; 0 launches one program per unit. One per SM is not
#: offered: with no second program to run while one waits it was 0.786-0.995x of the table's
#: rows at 12 prefill buckets on the H200, where two per SM were 0.802-1.026x
#: (``bench/results/persistent-h200-2026-12-04``).
PERSISTENT = (0, 2, 4)
#: Whether GEMM1 writes the intermediate in sorted order (a row per padded position of its row
#: blocks) so GEMM2 loads each activation tile through a TMA descriptor, as it does its weights,
#: instead of gathering the rows by routed pair with pointers (an address and a mask per element
#: loaded, in registers GEMM2's short K loop has few of: 2-3 steps at I = 192-256).
A_TMA = (0, 1)
#: Whether GEMM1's epilogue writes GEMM2's block-fp8 input itself (fp8 rows, one scale per 128
#: columns) instead of bf16 rows that a separate launch quantizes: one launch and a bf16 write
#: and read of the (pairs, I) intermediate less, for tiles of whole 128-column groups.
FP8_OUT = (0, 1)


class MoetuneGroupedKernel(OwnTritonKernel):
    """Grouped-GEMM fused MoE for prefill: ``g1_*`` configures GEMM1 (+activation), ``g2_*``
    GEMM2 (+weighted reduce), each in vLLM's config space."""

    name = "moetune_grouped"
    params = config_params("g1_") + config_params("g2_") + (
        Param("g2_N_TILES", N_TILES, default=1), Param("g2_N_MAJOR", N_MAJOR, default=0),
        Param("g2_PERSISTENT", PERSISTENT, default=0), Param("g2_A_TMA", A_TMA, default=0),
        Param("g1_FP8_OUT", FP8_OUT, default=0),
        Param("W_TMA", W_TMA, default=0),
        Param("g1_PAIR_TMA", PAIR_TMA, default=0),
        Param("REDUCE", REDUCES))
    kernels_module = "moetune.runtime.kernels._grouped"
    #: Pairs routed nowhere are in no expert's group (``_align``); GEMM1 zeroes their rows
    #: where GEMM2 stores by pair (``_grouped``).
    skips_unrouted = True

    # --- parameters --------------------------------------------------------------------------
    @classmethod
    def check_params(cls, problem: MoEProblem, params: dict[str, Any]) -> str | None:
        element = operand_bytes(problem)
        for gemm, weight_tiles in (("g1", 2 if problem.gated else 1), ("g2", 1)):
            config = config_of(params, f"{gemm}_")
            block_m, block_n, block_k = (config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"],
                                         config["BLOCK_SIZE_K"])
            if block_m < MIN_BLOCK_M:
                return f"{gemm}_BLOCK_SIZE_M={block_m}: tl.dot needs at least {MIN_BLOCK_M} rows"
            # The pipeline keeps num_stages activation tiles and weight tiles (gate and up).
            need = shared_memory_bytes(block_m, weight_tiles * block_n, block_k,
                                       config["num_stages"], element)
            if need > shared_memory_limit():
                return (f"{gemm}: needs {need} B of shared memory, the GPU has "
                        f"{shared_memory_limit()} B per block")
            if problem.quant is QuantScheme.FP8_BLOCK_128X128 and QUANT_BLOCK[1] % block_k:
                return (f"{gemm}_BLOCK_SIZE_K={block_k} spans two {QUANT_BLOCK[1]}-wide scale "
                        "blocks")
        n_tiles, block_n = params["g2_N_TILES"], params["g2_BLOCK_SIZE_N"]
        if n_tiles > -(-problem.hidden_size // block_n):
            return (f"g2_N_TILES={n_tiles} tiles of {block_n} columns: H={problem.hidden_size} "
                    "leaves some empty in every program")
        if params["W_TMA"]:
            reason = _tma_rows_reason("W_TMA=1: weight", element, H=problem.hidden_size,
                                      I=problem.intermediate_size)
            if reason:
                return reason
        if params["g2_A_TMA"]:
            reason = _tma_rows_reason("g2_A_TMA=1: intermediate", element,
                                      I=problem.intermediate_size)
            if reason:
                return reason
            m1, m2 = params["g1_BLOCK_SIZE_M"], params["g2_BLOCK_SIZE_M"]
            if m1 != m2:
                return (f"g2_A_TMA=1 loads GEMM1's row blocks as they lie: g1_BLOCK_SIZE_M={m1} "
                        f"!= g2_BLOCK_SIZE_M={m2}")
        if params["g1_PAIR_TMA"]:
            if not params["W_TMA"]:
                return "g1_PAIR_TMA=1 loads through TMA: it needs W_TMA=1"
            if not problem.gated:
                return "g1_PAIR_TMA=1 pairs gate and up tiles: the layer is not gated"
            # Block-fp8 sizes are multiples of the block, so the up half starts a block too.
            rows, block_n = QUANT_BLOCK[0], params["g1_BLOCK_SIZE_N"]
            if problem.quant is QuantScheme.FP8_BLOCK_128X128 and rows % block_n:
                return (f"g1_PAIR_TMA=1: a tile's gate half (g1_BLOCK_SIZE_N={block_n}) spans "
                        f"more than one {rows}-row scale block")
        if params["g1_FP8_OUT"]:
            if problem.quant is not QuantScheme.FP8_BLOCK_128X128:
                return ("g1_FP8_OUT=1 writes GEMM2's input with a scale per 128 columns: only "
                        "block-fp8 layers quantize it so (others per row, across all of I)")
            block_n = params["g1_BLOCK_SIZE_N"]
            if block_n % QUANT_BLOCK[1]:
                return (f"g1_FP8_OUT=1: a tile of g1_BLOCK_SIZE_N={block_n} columns holds no whole "
                        f"{QUANT_BLOCK[1]}-column group to scale")
        reduce = params["REDUCE"]
        if problem.topk == 1 and reduce != "atomic":
            return f"top-1 stores its rows directly: REDUCE={reduce} changes nothing"
        if problem.dtype is DType.FLOAT32 and reduce == "atomic_out":
            return "float32 output: REDUCE=atomic already adds into the output"
        return None

    @classmethod
    def run_to_run(cls, problem: MoEProblem, params: dict[str, Any]) -> str | None:
        """A token's top-k rows meet by atomics unless ``REDUCE=sum``."""
        return atomic_order_reason(params["REDUCE"], problem.topk)

    @classmethod
    def seed_params(cls, problem: MoEProblem, sku: SKU) -> dict[str, Any] | None:
        """vLLM's config for both GEMMs (``from_gemm_configs``), so the family starts where
        serving is; None where even that cannot fit here."""
        config = vllm_config(problem, sku)[0]
        return cls.from_gemm_configs(problem, config, config)

    @classmethod
    def gemm_configs(cls, problem: MoEProblem,
                     params: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
        """The inverse of ``from_gemm_configs``: in vLLM's terms GEMM1's tile of a gated layer
        spans gate and up columns, twice this kernel's ``BLOCK_SIZE_N`` (which counts each)."""
        g1 = config_of(params, "g1_")
        if problem.gated:
            g1["BLOCK_SIZE_N"] *= 2
        return g1, config_of(params, "g2_")

    @classmethod
    def from_gemm_configs(cls, problem: MoEProblem, gemm1: dict[str, int],
                          gemm2: dict[str, int]) -> dict[str, Any] | None:
        """This kernel's parameters doing the work per program of two vLLM-style GEMM configs:
        GEMM1's BLOCK_SIZE_N is halved for gated layers (vLLM's tile spans gate and up columns,
        this kernel's spans that many of each), tiles get at least 16 rows, and stages drop
        until both GEMMs fit in shared memory. One tile of H per GEMM2 program, as vLLM's. The
        reduce is the fused one that rounds least often where the dtype allows (``atomic_out``:
        one launch less than ``atomic``). Weight tiles come through TMA where the device and
        row alignment allow: on the H200 it was faster at 59 of 63 same-tile pairs over ten
        preset buckets (geomean 1.045x, 0.96-1.21x; ``bench/results/tma-h200-2026-12-02``), and
        the search still tries pointers; gate and up tiles in one box where allowed (1.023x over
        14 buckets, 0.998-1.091x: ``bench/results/kernels-h200-2026-12-03c``; under block-fp8
        scales 1.003x over 6 DeepSeek-V3 buckets, 0.994-1.010x, with 15% fewer instructions per
        K step: ``bench/results/kernels-h200-2026-12-03d``). GEMM2 in vLLM's program order
        (``g2_N_MAJOR=0``: the column-major order was 0.997x over 16 buckets, won only at
        DeepSeek-V3 and Qwen3-235B at 4096 tokens, and is left to the search). None if no
        stage count fits."""
        g1 = dict(gemm1)
        if problem.gated:
            g1["BLOCK_SIZE_N"] = max(cls.choices("g1_BLOCK_SIZE_N")[0], g1["BLOCK_SIZE_N"] // 2)
        reduce = "atomic" if problem.topk == 1 or problem.dtype is DType.FLOAT32 else "atomic_out"
        params: dict[str, Any] = {"REDUCE": reduce, "g2_N_TILES": 1, "g2_N_MAJOR": 0,
                                  "g2_PERSISTENT": 0, "g2_A_TMA": 0, "g1_FP8_OUT": 0,
                                  "W_TMA": 0, "g1_PAIR_TMA": 0}
        for prefix, config in (("g1_", g1), ("g2_", dict(gemm2))):
            config["BLOCK_SIZE_M"] = max(config["BLOCK_SIZE_M"], MIN_BLOCK_M)
            params |= with_prefix(config, prefix)
        while cls.check_params(problem, params) is not None:
            stages = [k for k in ("g1_num_stages", "g2_num_stages") if params[k] > 2]
            if not stages:
                return None
            for key in stages:
                params[key] -= 1
        for faster in ({**params, "W_TMA": 1, "g1_PAIR_TMA": 1}, {**params, "W_TMA": 1}):
            if cls.check_params(problem, faster) is None:
                return faster
        return params

    # --- execution ---------------------------------------------------------------------------
    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        from moetune.runtime.kernels._grouped import launcher

        return launcher(problem, params, weights)


def _tma_rows_reason(what: str, element: int, **sizes: int) -> str | None:
    """Why TMA cannot load ``what``'s rows (``sizes``: row length per name, ``element`` bytes
    each), prefixed by ``what``'s parameter: no TMA unit here, or rows not 16-byte aligned."""
    reason = tma_reason()
    if reason:
        return f"{what.split(':')[0]}: {reason}"
    for name, size in sizes.items():
        if size * element % TMA_ALIGN:
            return f"{what} rows of {name}={size} elements are not {TMA_ALIGN}-byte aligned"
    return None
