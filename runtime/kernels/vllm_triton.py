"""vLLM's own Triton fused-MoE path (``runtime/vllm/triton.py``), run as vLLM runs a layer:
as vLLM configures it (``vllm_triton``), and with a searched config (``vllm_triton_tuned``).

``vllm_triton`` is what vLLM serves unquantized and fp8 MoE layers with on CUDA under tensor
parallelism, so it is the CUDA rule's pick wherever vLLM's code and compiled ops are here: every
CUDA winner is timed against vLLM's kernel, configs and glue of the installed version. It has no
parameters: vLLM chooses its configs itself, from its tuned files (and in 0.34 GEMM2's
``_down.json``) or its default heuristic, which ``RuleChoice.configs`` names.

``vllm_triton_tuned`` is the same kernel and glue with one Triton config for both GEMMs, the
space vLLM's ``benchmarks/kernels/benchmark_moe.py`` searches, set through vLLM's public
``override_config``: a winner improves on vLLM's configs without leaving vLLM's code. Serving
runs it as the layer's own ``apply`` inside that setting (``in_engine``), not as a second
modular kernel. A separate family, so that the rule's pick stays ``vllm_triton`` with ``{}``.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import Any, Callable, ClassVar

import torch

from moetune.runtime.kernels._vllm_layer import VllmLayerKernel
from moetune.runtime.kernels.base import MoEFn, MoEWeights, Param, write
from moetune.runtime.kernels.triton_config import (check_config, config_of, config_params,
                                                   vllm_config)
from moetune.runtime.platform import SKU
from moetune.runtime.problem import Activation, DType, MoEProblem, QuantScheme
from moetune.runtime.vllm.triton import config_override, layer, vllm_triton


class VllmTritonKernel(VllmLayerKernel):
    """vLLM's ``TritonExperts`` in its modular kernel, behind its no-DP prepare step."""

    name = "vllm_triton"
    #: vLLM's path sums a token's top-k rows in a fixed order (bitwise the same in 7 engine
    #: processes on an H100: bench/results/vllm-e2e-rounds-h100-2026-12-07).
    deterministic = True
    build = staticmethod(layer)
    quants = frozenset({QuantScheme.NONE, QuantScheme.FP8_PER_TENSOR,
                        QuantScheme.FP8_PER_CHANNEL, QuantScheme.FP8_BLOCK_128X128})
    dtypes = frozenset({DType.FLOAT16, DType.BFLOAT16})
    #: The serving-relevant path; vLLM's gated GELU is its exact erf form, not compared here.
    activations = frozenset({Activation.SILU})
    gated = True

    @classmethod
    def _supports_device(cls, problem: MoEProblem, sku: SKU) -> str | None:
        return super()._supports_device(problem, sku) or vllm_triton()[1]


class VllmTritonTunedKernel(VllmTritonKernel):
    """vLLM's ``TritonExperts`` as ``vllm_triton`` runs it, with ``params`` as the Triton config
    of both GEMMs (vLLM's ``override_config``).

    vLLM's pick is a point of the space (``seed_params``), and its launcher clamps
    ``BLOCK_SIZE_K`` to the fp8 block as it does for its own configs. Where vLLM 0.34 reads a
    ``_down.json`` for GEMM2 (block fp8 with DeepGEMM's E8M0 scales on sm_90: its sorted-A TMA
    path), an override runs GEMM2 with the override's config instead: that GEMM2 is vLLM's pick
    and no point of this family (``vllm_triton`` keeps it).
    """

    name = "vllm_triton_tuned"
    params: ClassVar[tuple[Param, ...]] = config_params()

    @classmethod
    def seed_params(cls, problem: MoEProblem, sku: SKU) -> dict[str, Any] | None:
        """vLLM's own pick for ``problem`` (its tuned file's entry, else its default)."""
        return vllm_config(problem, sku)[0]

    @classmethod
    def check_params(cls, problem: MoEProblem, params: dict[str, Any]) -> str | None:
        return check_config(problem, config_of(params))

    @classmethod
    def gemm_configs(cls, problem: MoEProblem,
                     params: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
        """The one config, for both GEMMs."""
        config = config_of(params)
        return config, config

    @classmethod
    def from_gemm_configs(cls, problem: MoEProblem, gemm1: dict[str, int],
                          gemm2: dict[str, int]) -> dict[str, Any] | None:
        """The config where both GEMMs share it (vLLM's override sets one for both)."""
        return dict(gemm1) if gemm1 == gemm2 else None

    @classmethod
    def in_engine(cls, problem: MoEProblem, params: dict[str, Any]
                  ) -> Callable[[], AbstractContextManager[None]]:
        """vLLM's config override with ``params``: what serving enters around the layer's own
        ``TritonExperts.apply``."""
        return functools.partial(config_override, config_of(params))

    @classmethod
    def prepare(cls, problem: MoEProblem, params: dict[str, Any], weights: MoEWeights) -> MoEFn:
        run = cls.build(problem, weights.w13, weights.w2, weights.w13_scale, weights.w2_scale)
        setting = cls.in_engine(problem, params)

        def fn(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
            with setting():
                result = run(x, topk_weights, topk_ids)
            return write(result, out)

        return fn
