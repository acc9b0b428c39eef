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

from moetune.serving.quant import weight_quant  # noqa: E402

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


# --- the hook on vLLM's real CPUExpertsFp8 ---------------------------------------------------
@pytest.fixture
def real_cpu_fp8(monkeypatch):
    """vLLM's CPUExpertsFp8 and its fp8 packing function, hooked here and unhooked after.

    vLLM's packing op (``convert_weight_packed``) is built for AMX CPUs only; where it is
    missing, a packer that zeroes the weights stands in for it (so a kernel that read the
    packed tensors would be wrong), and the real one runs everywhere else.
    """
    import importlib

    from moetune.runtime.vllm import classes
    from moetune.serving import prepack

    spec = next(s for s in classes.CPU_SPECS if s.name == "CPUExpertsFp8")
    cls = spec.load()
    monkeypatch.setattr(cls, "apply", cls.__dict__["apply"])
    module = importlib.import_module(prepack.MODULE)
    packer = getattr(module, prepack.FUNCTION)
    if not hasattr(torch.ops._C, "convert_weight_packed"):
        def packer(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.zeros_like(w13), torch.zeros_like(w2)
    monkeypatch.setattr(module, prepack.FUNCTION, packer)
    return spec, cls, module


def load_layer(module, weights: MoEWeights) -> torch.nn.Module:
    """What vLLM's fp8 method does for its CPU backend: pack, then ``replace_parameter``."""
    from vllm.model_executor.utils import replace_parameter

    from moetune.serving import prepack

    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(weights.w13.clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(weights.w2.clone(), requires_grad=False)
    packed13, packed2 = getattr(module, prepack.FUNCTION)(layer.w13_weight, layer.w2_weight)
    replace_parameter(layer, "w13_weight", packed13)
    replace_parameter(layer, "w2_weight", packed2)
    return layer


def test_cpu_fp8_winners_run_on_the_plain_copy_kept_while_vllm_packed(real_cpu_fp8, tmp_path,
                                                                      cpu_sku):
    from moetune.runtime.problem import Shape
    from moetune.serving import hook
    from moetune.serving.settings import Settings
    from moetune.serving.state import PluginState

    from tests.vllm_tables import write_winners

    spec, cls, module = real_cpu_fp8
    shape = Shape(H, I, E, 2, "bfloat16", "fp8_block_128x128", "silu", True, False)
    table = write_winners(tmp_path / "t.db", shape, (1, 8, 64), "torch_grouped", sku=cpu_sku)
    other = Shape(H, 2 * I, E, 2, "bfloat16", "fp8_block_128x128", "silu", True, False)
    state = PluginState(Settings(table=table))
    assert hook.install(state, (spec,)) == ["CPUExpertsFp8"]
    ours = make_weights(shape.problem(1), "cpu", seed=5)
    unlisted = load_layer(module, make_weights(other.problem(1), "cpu", seed=6))
    assert not hasattr(unlisted.w13_weight, "_moetune_plain")  # no row for its sizes: no copy
    layer = load_layer(module, ours)
    experts = cls(moe_config(), vc.fp8_w8a16_moe_quant_config(ours.w13_scale, ours.w2_scale,
                                                             block_shape=[128, 128]))
    for m in (1, 8, 64):
        x = torch.randn(m, H, dtype=torch.bfloat16)
        topk_weights = torch.rand(m, 2)
        topk_ids = torch.stack([torch.randperm(E)[:2] for _ in range(m)]).to(torch.int32)
        out = torch.empty(m, H, dtype=torch.bfloat16)
        experts.apply(output=out, hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight,
                      topk_weights=topk_weights, topk_ids=topk_ids,
                      activation=MoEActivation.SILU, global_num_experts=E, expert_map=None,
                      a1q_scale=None, a2_scale=None, workspace13=None, workspace2=None,
                      expert_tokens_meta=None, apply_router_weight_on_input=False)
        problem = shape.problem(m)
        ref = default_registry.get("reference").prepare(problem, {}, ours)(x, topk_weights,
                                                                         topk_ids)
        assert relative_error(out, ref) <= tolerance(problem) / 4, m
    assert state.counts == {"H=256 I=256 E=8 topk=2 bfloat16 fp8_block_128x128 silu":
                            {"hit": 3, "miss": 0, "fallback": 0}}
    assert state.plain_copy_bytes == ours.w13.numel() + ours.w2.numel()  # fp8: a byte each
    assert not hasattr(layer.w13_weight, "_moetune_plain")  # taken off vLLM's parameter
