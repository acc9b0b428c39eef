"""fp8 layers described from vLLM's real quant config objects, in this process (no engine).

Each case builds the ``FusedMoEQuantConfig`` vLLM's fp8 methods build (``fp8_w8a16_...`` for the
CPU and Marlin backends, ``fp8_w8a8_...`` for the others) around scales in vLLM's layout, on a
real experts object, and checks the scheme moetune reads and that its kernel computes the layer
from vLLM's scales as from moetune's own.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moetune.runtime.kernels.base import MoEWeights
from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.registry import default_registry
from moetune.tuner.gate import relative_error, tolerance
from moetune.tuner.inputs import make_batch, make_weights

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (bash scripts/setup.sh --vllm)", allow_module_level=True)

from vllm.model_executor.layers.fused_moe import config as vc  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (  # noqa: E402
    CPUExpertsFp8, CPUExpertsMxfp4)
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts  # noqa: E402

from moetune.runtime.vllm.quant import weight_quant  # noqa: E402

E, H, I = 8, 256, 256


def moe_config() -> vc.FusedMoEConfig:
    return vc.FusedMoEConfig(
        num_experts=E, experts_per_token=2, hidden_dim=H, intermediate_size=I,
        num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU, device="cpu",
        routing_method=vc.RoutingMethodType.Renormalize,
        moe_parallel_config=vc.FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16)


def vllm_scales(weights: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """moetune's scales as vLLM's fp8 methods hold them: per channel (E, N, 1), else as is."""
    if weights.quant is QuantScheme.FP8_PER_CHANNEL:
        return weights.w13_scale[..., None], weights.w2_scale[..., None]
    return weights.w13_scale, weights.w2_scale


@pytest.mark.parametrize("scheme,experts_cls", [
    (QuantScheme.FP8_BLOCK_128X128, CPUExpertsFp8),  # vLLM's CPU backend: W8A16, block
    (QuantScheme.FP8_PER_CHANNEL, TritonExperts),  # W8A16 config: groups read from the scales
    (QuantScheme.FP8_PER_TENSOR, TritonExperts),
], ids=lambda v: getattr(v, "value", None) or v.__name__)
def test_scheme_and_scales_come_from_vllms_quant_config(scheme, experts_cls):
    problem = MoEProblem(21, H, I, E, 2, dtype="bfloat16", quant=scheme)
    ours = make_weights(problem, "cpu", seed=3)
    s13, s2 = vllm_scales(ours)
    block = [128, 128] if scheme is QuantScheme.FP8_BLOCK_128X128 else None
    experts = experts_cls(moe_config(), vc.fp8_w8a16_moe_quant_config(s13, s2, block_shape=block))
    got, scales, why = weight_quant(experts, ours.w13, ours.w2)
    assert (got, why) == (scheme, "")
    assert scales is not None
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(scales, (s13, s2)))  # views
    batch = make_batch(problem, "cpu", seed=4)
    ref = default_registry.get("reference").prepare(problem, {}, ours)(*batch.args())
    theirs = MoEWeights(ours.w13, ours.w2, got, *scales)
    out = default_registry.get("torch_loop").prepare(problem, {}, theirs)(*batch.args())
    assert relative_error(out, ref) <= tolerance(problem) / 4


def _fp8(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float8_e4m3fn)


W13, W2 = _fp8(E, 2 * I, H), _fp8(E, H, I)
BLOCK_SCALES = (torch.ones(E, 2 * I // 128, H // 128), torch.ones(E, H // 128, I // 128))


@pytest.mark.parametrize("experts_cls,quant_config,why", [
    (TritonExperts, vc.fp8_w8a8_moe_quant_config(torch.ones(E), torch.ones(E)),
     "activations reach the experts quantized to fp8 by vLLM"),
    (TritonExperts, vc.fp8_w8a8_moe_quant_config(torch.ones(E), torch.ones(E), torch.ones(1),
                                                 torch.ones(1)), "static activation scales"),
    (CPUExpertsFp8, vc.fp8_w8a16_moe_quant_config(
        torch.ones(E, 2 * I // 64, H // 64), torch.ones(E, H // 64, I // 64), block_shape=[64, 64]),
     "fp8 block 64x64"),
    (CPUExpertsFp8, vc.fp8_w8a16_moe_quant_config(
        *(s.to(torch.uint8) for s in BLOCK_SCALES), block_shape=[128, 128]),
     "w13 scales ((8, 4, 2), torch.uint8) are not fp8_block_128x128 float32 scales (8, 4, 2)"),
    (CPUExpertsMxfp4, vc.mxfp4_w4a16_moe_quant_config(torch.ones(1), torch.ones(1)),
     "quantized (mxfp4)"),
], ids=["w8a8", "static", "block64", "e8m0-scales", "mxfp4"])
def test_layers_moetune_does_not_cover_say_why(experts_cls, quant_config, why):
    scheme, scales, reason = weight_quant(experts_cls(moe_config(), quant_config), W13, W2)
    assert (scheme, scales) == (None, None) and why in reason


def test_unquantized_layers_have_no_scales():
    experts = TritonExperts(moe_config(), vc.FusedMoEQuantConfig.make())
    assert weight_quant(experts, W13.float(), W2.float()) == (QuantScheme.NONE, None, "")
