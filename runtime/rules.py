"""Rule-based selection: what serving picks without a table. One explicit function per platform.

The rule's pick is also every bucket's baseline in tuning, so each winner carries its speedup
over what users get today.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from moetune.runtime.kernels.aiter_triton import AiterTritonKernel
from moetune.runtime.kernels.base import params_key
from moetune.runtime.kernels.torch_loop import TorchLoopKernel
from moetune.runtime.kernels.triton_config import vllm_config_variants
from moetune.runtime.kernels.vllm_cpu_experts import VllmCpuExpertsKernel
from moetune.runtime.kernels.vllm_triton import VllmTritonKernel
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.vllm.configs import configs_label
from moetune.runtime.vllm.versions import installed


@dataclasses.dataclass(frozen=True)
class RuleChoice:
    """What the rule runs, and why. ``vllm``: the vLLM version whose pick it is (None where
    the pick is moetune's own, or does not change between vLLM releases); ``configs``: the
    vLLM tuned-config file(s) its config comes from, ``"default"`` for vLLM's default
    heuristic (None where that does not apply). A row's baseline is this choice when
    ``BaselineRecord.stands_for`` says so."""

    kernel: str
    params: dict[str, Any]
    reason: str
    vllm: str | None = None
    configs: str | None = None


def cpu_rule(problem: MoEProblem, sku: SKU) -> RuleChoice:
    """CPU: what vLLM runs there, its C++ fused-MoE kernel (``CPUUnquantizedExperts``), when
    vLLM is installed and runs the problem; the plain per-expert torch loop otherwise, saying why."""
    ok, why = VllmCpuExpertsKernel.supports(problem, sku)
    if ok:
        return RuleChoice("vllm_cpu_experts", {},
                          f"CPU rule: vLLM's CPU fused-MoE kernel (isa "
                          f"{VllmCpuExpertsKernel.isa(problem)}), what vLLM runs here",
                          vllm=installed())
    return RuleChoice("torch_loop", {}, f"CPU rule: plain torch per-expert loop ({why})")


def rocm_rule(problem: MoEProblem, sku: SKU) -> RuleChoice:
    """ROCm, as vLLM's aiter integration decides (the seed rule):
    block-scaled fp8 -> blockscale kernel; per-channel fp8 with the router weight on the input
    and top-1 routing -> tkw1; everything else -> aiter's fused_moe."""
    if problem.quant is QuantScheme.FP8_BLOCK_128X128:
        return RuleChoice("aiter_asm_blockscale", {}, "ROCm rule: fp8 block 128x128 -> blockscale")
    if (problem.quant is QuantScheme.FP8_PER_CHANNEL and problem.router_weight_on_input
            and problem.topk == 1):
        return RuleChoice("aiter_asm_tkw1", {}, "ROCm rule: fp8 per-channel, top-1, weight on input -> tkw1")
    return RuleChoice("aiter_fused_moe", {"block_size_M": 0},
                      "ROCm rule: aiter fused_moe with its own block size")


def cuda_rule(problem: MoEProblem, sku: SKU) -> RuleChoice:
    """CUDA: vLLM's own Triton fused-MoE path (``vllm_triton``), which chooses its configs
    itself, wherever vLLM's code and compiled ops are here. Elsewhere (no vLLM, or no CUDA
    build of it) an emulation stands in: aiter's fork of vLLM's Triton GEMM with the config
    vLLM would pick, read from its files, and torch ops between the GEMMs. The torch loop
    where neither runs, saying why."""
    return cuda_variants(problem, sku)[0]


def cuda_variants(problem: MoEProblem, sku: SKU) -> tuple[RuleChoice, ...]:
    """The CUDA rule: vLLM's own path where it runs; else the emulation with each config vLLM
    may run (``vllm_config_variants``), its pick first."""
    ok, why = VllmTritonKernel.supports(problem, sku)
    if ok:
        configs = configs_label(problem, sku)
        return (RuleChoice("vllm_triton", {}, f"CUDA rule: vLLM {installed()}'s own Triton "
                                              f"fused-MoE path ({configs})", vllm=installed(),
                           configs=configs),)
    emulated, reason = AiterTritonKernel.supports(problem, sku)
    if not emulated:
        return (RuleChoice("torch_loop", {}, f"CUDA rule: torch loop ({why}; {reason})"),)
    return tuple(RuleChoice("aiter_triton", config,
                            f"CUDA rule: an emulation of vLLM's Triton path ({why}): aiter's "
                            f"fork of its GEMM with {source}")
                 for config, source in vllm_config_variants(problem, sku))


RULES: dict[Vendor, Callable[[MoEProblem, SKU], RuleChoice]] = {
    Vendor.CPU: cpu_rule,
    Vendor.NVIDIA: cuda_rule,
    Vendor.AMD: rocm_rule,
}


def rule_choice(problem: MoEProblem, sku: SKU) -> RuleChoice:
    """The rule-based pick for ``problem`` on ``sku``."""
    return RULES[sku.vendor](problem, sku)


def rule_variants(problem: MoEProblem, sku: SKU) -> tuple[RuleChoice, ...]:
    """What serving may run for ``problem`` without a table on machines of this SKU, the
    rule's pick here first: on CUDA each config vLLM picks with and without its tuned files;
    on the CPU vLLM's kernel and, for machines without vLLM, the torch loop. The tuner times
    every variant beside the winner, so a row stays valid wherever today's rule is one of them.
    """
    if sku.vendor is Vendor.NVIDIA:
        return cuda_variants(problem, sku)
    variants = [rule_choice(problem, sku)]
    if (sku.vendor is Vendor.CPU and variants[0].kernel != "torch_loop"
            and TorchLoopKernel.supports(problem, sku)[0]):
        variants.append(RuleChoice("torch_loop", {}, "CPU rule without vLLM: plain torch "
                                                     "per-expert loop"))
    return tuple(variants)


def is_rule_pick(kernel: str, params: dict[str, Any], problem: MoEProblem, sku: SKU) -> bool:
    """Whether ``kernel`` with ``params`` is what the rule picks for ``problem`` here: the
    engine's own choice, which the engine serves best itself."""
    rule = rule_choice(problem, sku)
    return (kernel, params_key(params)) == (rule.kernel, params_key(rule.params))
