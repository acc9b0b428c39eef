"""``aiter_triton`` with its own Triton config for each GEMM.

vLLM runs GEMM1 (M x 2I x H) and GEMM2 (M x H x I) with one config although their shapes differ
by far; SGLang tunes them apart. Parameters are prefixed ``g1_`` and ``g2_``; when the two
BLOCK_SIZE_M differ the routing is aligned once per GEMM.
"""

from __future__ import annotations

from typing import Any

from moetune.runtime.kernels.aiter_triton import AiterTritonKernel
from moetune.runtime.platform import SKU
from moetune.runtime.problem import MoEProblem
from moetune.runtime.kernels.triton_config import config_of, config_params, with_prefix
from moetune.runtime.vllm.configs import vllm_config


class AiterTritonSplitKernel(AiterTritonKernel):
    """Same kernels as ``aiter_triton``; the search space is the square of vLLM's."""

    name = "aiter_triton_split"
    params = config_params("g1_") + config_params("g2_")

    @classmethod
    def configs(cls, params: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
        return config_of(params, "g1_"), config_of(params, "g2_")

    @classmethod
    def seed_params(cls, problem: MoEProblem, sku: SKU) -> dict[str, Any] | None:
        config = vllm_config(problem, sku)[0]
        return with_prefix(config, "g1_") | with_prefix(config, "g2_")
