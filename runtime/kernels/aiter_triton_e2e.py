"""Both GEMMs in one kernel (aiter's ``moe_op_e2e``, non-persistent): each program computes a
(BLOCK_SIZE_M x BLOCK_SIZE_N / 2) tile of the activated intermediate and atomically adds its
share of GEMM2 into an (M, topk, H) output (float32 for bfloat16 layers); the intermediate never reaches memory.

aiter's kernel fuses gated SiLU only, multiplies the router weight after GEMM2, and has no
working fp8 path (GEMM2's input is never quantized: "TODO scale acc"). It takes the sorted-id
length and the hidden size as compile-time constants, so the length is rounded up to a power of
two to bound recompiles (it still recompiles for each num_tokens below BLOCK_SIZE_M). The
top-k sum of that output is written into the caller's.
"""

from __future__ import annotations

from typing import Any

import torch

from moetune.runtime import aiter_loader
from moetune.runtime.kernels.aiter_triton import AiterTritonKernel
from moetune.runtime.kernels.base import MoEFn, MoEWeights
from moetune.runtime.kernels.triton_config import (
    config_of, config_params, operand_bytes, shared_memory_bytes, shared_memory_limit)
from moetune.runtime.platform import SKU
from moetune.runtime.problem import Activation, MoEProblem, QuantScheme

#: BLOCK_SIZE_N tiles GEMM1's 2I (gate and up interleaved), BLOCK_SIZE_K1 tiles H for GEMM1,
#: BLOCK_SIZE_K2 tiles GEMM2's output H.
SPACE: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128),
    "BLOCK_SIZE_N": (32, 64, 128, 256),
    "BLOCK_SIZE_K1": (32, 64, 128),
    "BLOCK_SIZE_K2": (32, 64, 128, 256),
    "GROUP_SIZE_M": (1, 8, 32),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
}


class AiterTritonE2EKernel(AiterTritonKernel):
    """One launch for the whole layer after routing; unquantized gated SiLU only."""

    name = "aiter_triton_e2e"
    #: GEMM2's partial products over the intermediate tiles meet by atomic adds.
    deterministic = False
    params = config_params(space=SPACE, extra={})
    modules = ("e2e",)
    quants = frozenset({QuantScheme.NONE})
    activations = frozenset({Activation.SILU})
    gated = True
    router_weight_on_input = False  # applied after GEMM2

    @classmethod
    def seed_params(cls, problem: MoEProblem, sku: SKU) -> dict[str, Any] | None:
        return None  # its space is not vLLM's: no serving default to start from

    @classmethod
    def gemm_configs(cls, problem: MoEProblem, params: dict[str, Any]) -> None:
        """None: one tile config spans both GEMMs, in a space that is not vLLM's."""
        return None

    @classmethod
    def from_gemm_configs(cls, problem: MoEProblem, gemm1: dict[str, int],
                          gemm2: dict[str, int]) -> None:
        return None

    @classmethod
    def check_params(cls, problem: MoEProblem, params: dict[str, Any]) -> str | None:
        c = config_of(params, space=SPACE)
        elem = operand_bytes(problem)
        need = max(
            shared_memory_bytes(c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c["BLOCK_SIZE_K1"],
                                c["num_stages"], elem),
            shared_memory_bytes(c["BLOCK_SIZE_M"], c["BLOCK_SIZE_K2"], c["BLOCK_SIZE_N"] // 2, 2, elem))
        if need > shared_memory_limit():
            return f"needs {need} B of shared memory, the GPU has {shared_memory_limit()} B per block"
        # GEMM2 masks its H tiles only when GEMM1's K tiles needed masking (one EVEN_K flag).
        hidden = problem.hidden_size
        if hidden % c["BLOCK_SIZE_K1"] == 0 and hidden % c["BLOCK_SIZE_K2"]:
            return (f"hidden {hidden} divides BLOCK_SIZE_K1 but not BLOCK_SIZE_K2: GEMM2 would "
                    "write past the row")
        return None

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        import triton

        from moetune.runtime.kernels._align import align, padded_length

        e2e = aiter_loader.load("e2e").module
        config = config_of(params, space=SPACE)
        block_m = config["BLOCK_SIZE_M"]
        w13, w2 = weights.w13, weights.w2
        num_experts, hidden = w2.shape[0], w2.shape[1]

        def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
            m, topk = topk_ids.shape
            length = triton.next_power_of_2(padded_length(topk_ids.numel(), block_m, num_experts))
            routing = align(topk_ids, block_m, num_experts, length)
            # The wrapper accumulates bfloat16 outputs in a float32 copy; others in place.
            y = torch.zeros(m, topk, hidden, dtype=x.dtype, device=x.device)
            y = e2e.e2e_moe(x, w13, w2, None, y, None, None, None, topk_weights,
                            routing.sorted_token_ids, topk_ids, routing.expert_ids,
                            routing.num_tokens_post_padded, True, topk, False, False, config)
            return torch.sum(y, dim=1, out=out)

        return run
