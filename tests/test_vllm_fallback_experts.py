"""``TritonOrDeepGemmExperts`` (vLLM's fp8 DEEPGEMM backend) against the installed vLLM's real
classes, on the CPU: what the adapter reads of it, and a real instance inside vLLM's real modular
kernel and no-EP prepare step, where vLLM's own pick (``_select_experts_impl``) decides each call.

DeepGEMM itself cannot run on a CPU, so its host-side answers are stood in for:
``has_deep_gemm`` says it is installed (vLLM's real ``_valid_deep_gemm`` rule then decides each
call) and ``get_mk_alignment_for_contiguous_layout`` answers 128 (DeepGEMM's answer on Hopper).
The ``apply`` of the inner ``DeepGemmExperts`` records what it is handed instead of running
DeepGEMM's CUDA GEMMs: the one fake of vLLM's experts in these tests, but for the test that needs
vLLM's Triton MoE kernel (which cannot run here either; it records instead, as
``tests/test_vllm_contract.py`` does, and says so). vLLM's block-fp8 activation quantizer is a
Triton kernel, unavailable on a CPU; vLLM's own torch implementation of the same quantization
(``QuantFP8._quantize_group_native``) stands in for it, for vLLM's prepare step and the hook
alike, so what the tests compare is which function the hook calls, with which arguments.
"""

from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh --vllm)")
pytestmark = pytest.mark.usefixtures("vllm_workspace")

from vllm.model_executor.layers.fused_moe import config as vllm_config  # noqa: E402
from vllm.model_executor.layers.fused_moe import modular_kernel  # noqa: E402
from vllm.model_executor.layers.fused_moe import utils as vllm_utils  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts import deep_gemm_moe  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts import fallback  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts import triton_deep_gemm_moe  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize import no_dp_ep  # noqa: E402
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8  # noqa: E402

from moetune.runtime.kernels.base import MoEWeights  # noqa: E402
from moetune.runtime.kernels.quant import quantize_weights  # noqa: E402
from moetune.runtime.problem import QuantScheme, Shape  # noqa: E402
from moetune.runtime.registry import default_registry  # noqa: E402
from moetune.runtime.rules import rule_choice  # noqa: E402
from moetune.runtime.vllm import classes  # noqa: E402
from moetune.serving import hook  # noqa: E402
from moetune.serving.call import APPLY_PARAMS, ApplyCall, wrap  # noqa: E402
from moetune.serving.quant import quantize_input  # noqa: E402
from moetune.serving.settings import Settings  # noqa: E402
from moetune.serving.state import PluginState  # noqa: E402

from tests.vllm_tables import write_winners  # noqa: E402

H, E, TOPK = 128, 4, 2
#: DeepGEMM's rule (``_valid_deep_gemm``) takes N <= 512 to Triton whatever the tokens: 128
#: here (DeepSeek-V3 under TP8 has 256); 640 goes to DeepGEMM from 128 tokens on.
SMALL_N, LARGE_N = 128, 640
FP8 = torch.float8_e4m3fn
SPEC = classes.FALLBACK
CLS = SPEC.load()
TRITON = classes.TRITON.load()


def moe_config(inter: int) -> vllm_config.FusedMoEConfig:
    return vllm_config.FusedMoEConfig(
        num_experts=E, experts_per_token=TOPK, hidden_dim=H, intermediate_size=inter,
        num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU, device="cpu",
        routing_method=vllm_config.RoutingMethodType.Renormalize,
        moe_parallel_config=vllm_config.FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16)


def fp8_block_layer(inter: int) -> tuple[vllm_config.FusedMoEQuantConfig, MoEWeights]:
    """Block-fp8 weights (float32 128 x 128 scales, as a checkpoint holds them; what vLLM's
    DeepGEMM backend leaves them without E8M0) and vLLM's quant config of them."""
    torch.manual_seed(0)
    w13, w2 = torch.randn(E, 2 * inter, H) / 8, torch.randn(E, H, inter) / 8
    q = quantize_weights(w13, w2, QuantScheme.FP8_BLOCK_128X128)
    config = vllm_config.fp8_w8a8_moe_quant_config(w1_scale=q.w13_scale, w2_scale=q.w2_scale,
                                                   block_shape=[128, 128])
    return config, q


def shape_of(inter: int) -> Shape:
    return Shape(H, inter, E, TOPK, "bfloat16", "fp8_block_128x128", "silu", True, False)


def group_quant_native(x: torch.Tensor, group_size: int, column_major_scales: bool = False,
                       **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``per_token_group_quant_fp8`` as its prepare step calls it (float32 scales,
    row-major unless vLLM 0.33's ``is_scale_transposed`` asks otherwise, no E8M0 without
    DeepGEMM), computed by vLLM's own torch implementation."""
    assert not kwargs, kwargs
    quant = SimpleNamespace(group_size=group_size, use_ue8m0=False,
                            column_major_scales=column_major_scales)
    return QuantFP8._quantize_group_native(quant, x)


@pytest.fixture
def deep_gemm(monkeypatch):
    """DeepGEMM's host-side answers stood in for (see the module docstring), every hook this
    test installs removed after it, and the calls the inner ``DeepGemmExperts`` gets recorded:
    ``(self, ApplyCall)``; it writes zeros."""
    monkeypatch.setattr(deep_gemm_moe, "has_deep_gemm", lambda: True)
    monkeypatch.setattr(deep_gemm_moe, "get_mk_alignment_for_contiguous_layout",
                        lambda: [128, 128])
    monkeypatch.setattr(vllm_utils, "per_token_group_quant_fp8", group_quant_native)
    for cls in (CLS, TRITON):  # inherited ones are set on the class itself, and removed after
        for name in ("apply", classes.DEFER_PROPERTY):
            monkeypatch.setattr(cls, name, classes.own(cls, name, inherited=True))
    seen = []

    def record(self, args):
        seen.append((self, ApplyCall(*args)))
        args[0].zero_()

    dg = deep_gemm_moe.DeepGemmExperts
    monkeypatch.setattr(dg, "apply", wrap(dg.__dict__["apply"], record))
    return seen


@pytest.fixture
def triton_kernel(monkeypatch):
    """vLLM's Triton MoE kernel cannot run on a CPU: ``TritonExperts.apply`` records what it is
    handed instead (``(self, ApplyCall, expects_unquantized_inputs)``) and writes zeros."""
    seen = []

    def record(self, args):
        seen.append((self, ApplyCall(*args), self.expects_unquantized_inputs))
        args[0].zero_()

    monkeypatch.setattr(TRITON, "apply", wrap(TRITON.__dict__["apply"], record))
    return seen


def routed(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(m, H, dtype=torch.bfloat16)
    topk_weights = torch.rand(m, TOPK)
    topk_ids = torch.stack([torch.randperm(E)[:TOPK] for _ in range(m)]).to(torch.int32)
    return x, topk_weights, topk_ids


def served_layer(state: PluginState, inter: int):
    config, q = fp8_block_layer(inter)
    experts = CLS(moe_config(inter), config)
    kernel = modular_kernel.FusedMoEKernel(no_dp_ep.MoEPrepareAndFinalizeNoDPEPModular(),
                                           experts)

    def forward(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, topk_weights, topk_ids = routed(m, seed)
        out = kernel.apply(x, q.w13, q.w2, topk_weights, topk_ids, MoEActivation.SILU, E, None,
                           False)
        return x, out, default_registry.get("reference").prepare(
            shape_of(inter).problem(m), {}, q)(x, topk_weights, topk_ids)

    return experts, config, forward


def prepared(x: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM's no-EP prepare step hands the experts when it quantizes."""
    a1q, scale = no_dp_ep._quantize_input(x, config, defer_input_quant=False)
    assert a1q.dtype == FP8 and scale is not None
    return a1q, scale


def assert_quantized_as_prepared(call: ApplyCall, x: torch.Tensor, config) -> None:
    a1q, scale = prepared(x, config)
    assert call.hidden_states.dtype == FP8
    assert torch.equal(call.hidden_states.view(torch.uint8), a1q.view(torch.uint8))
    assert torch.equal(call.a1q_scale, scale)
    direct = vllm_utils.moe_kernel_quantize_input(x, None, FP8, False, [128, 128])
    assert torch.equal(call.a1q_scale, direct[1])


# --- what the adapter reads of vLLM's classes ---------------------------------------------------

def test_the_class_picks_per_call_as_the_adapter_reads_it(deep_gemm):
    """The spec, the methods and attributes the hook reads, and vLLM's ``FallbackExperts.apply``
    being what ``hook._serve_fallback`` stands in for: the pick, then the picked ``apply``."""
    assert SPEC in classes.CUDA_SPECS and SPEC.held is classes.Held.PLAIN
    assert SPEC.defers_input_quant and SPEC.serves == "fallback_experts" and SPEC.deep_gemm
    classes.check_method(CLS, "apply", APPLY_PARAMS, hook._MARK, inherited=True)
    classes.check_fallback(CLS, TRITON)
    classes.check_property(CLS, classes.DEFER_PROPERTY, inherited=True)
    assert tuple(inspect.signature(getattr(CLS, classes.SELECT)).parameters) == \
        classes.SELECT_PARAMS
    config, q = fp8_block_layer(LARGE_N)
    experts = CLS(moe_config(LARGE_N), config)
    assert isinstance(experts.experts, deep_gemm_moe.DeepGemmExperts)
    assert type(getattr(experts, SPEC.serves)) is TRITON
    assert experts.quant_config is experts.fallback_experts.quant_config is config
    assert not experts.expects_unquantized_inputs
    body = inspect.getsource(fallback.FallbackExperts.apply).split('"""')[-1]
    assert "experts = self._select_experts_impl(hidden_states, w1, w2)" in body
    assert "experts.apply(" in body and body.count("self.") == 1  # nothing else of its own
    select = inspect.getsource(CLS._select_experts_impl)
    assert "is_deep_gemm_e8m0_used() or _valid_deep_gemm(hidden_states, w1, w2)" in select
    # The pick reads the activations' rows and layout, not their dtype: called on the
    # unquantized activations of a layer that defers, it picks as for the quantized ones.
    assert "hidden_states.dtype" not in inspect.getsource(deep_gemm_moe._valid_deep_gemm)
    # vLLM's real rule: N <= 512 (DeepSeek-V3 under TP8) is Triton's at every size, larger N
    # DeepGEMM's from its alignment (128 tokens) on.
    for inter in (SMALL_N, 256):
        small_config, qs = fp8_block_layer(inter)
        small = CLS(moe_config(inter), small_config)
        for m in (1, 128, 4096):
            x = torch.zeros(m, H, dtype=FP8)
            assert small._select_experts_impl(x, qs.w13, qs.w2) is small.fallback_experts
    for m, picked in ((1, experts.fallback_experts), (127, experts.fallback_experts),
                      (128, experts.experts)):
        x = torch.zeros(m, H, dtype=torch.bfloat16)
        assert experts._select_experts_impl(x, q.w13, q.w2) is picked


def test_deep_gemm_backend_keeps_checkpoint_weights_unless_its_e8m0_scales_are_used():
    """``Held.PLAIN`` and ``ExpertsSpec.deep_gemm``, from vLLM's sources: the fp8 oracle's
    DEEPGEMM backend is this class, its load-time preparation requantizes the weights only for
    E8M0 scales (and then the pick is DeepGEMM's at every call), and it leaves 128 x 128
    float32 weight scales in their layout otherwise (DeepGEMM's ``transform_sf_into_required_
    layout`` returns them as they are without the UE8M0 cast)."""
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as oracle
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    assert oracle.backend_to_kernel_cls(oracle.Fp8MoeBackend.DEEPGEMM) == [CLS]
    convert = inspect.getsource(oracle.convert_to_fp8_moe_kernel_format)
    branch = convert.split("Fp8MoeBackend.BATCHED_DEEPGEMM]:", 1)[1].split("elif", 1)[0]
    assert "prepare_fp8_moe_layer_for_deepgemm(" in branch
    prepare = inspect.getsource(fp8_utils.prepare_fp8_moe_layer_for_deepgemm)
    assert prepare.count("use_e8m0=is_deep_gemm_e8m0_used()") == 2
    post = inspect.getsource(fp8_utils.deepgemm_post_process_fp8_weight_block)
    assert "if use_e8m0:\n            requant_weight_ue8m0_inplace(wq, ws" in post
    scales = inspect.getsource(fp8_utils.deepgemm_post_process_weight_scale_block)
    assert "transform_sf_into_required_layout(" in scales
    from vllm.utils import deep_gemm as vllm_deep_gemm

    cast = inspect.getsource(vllm_deep_gemm.transform_sf_into_required_layout)
    assert "disable_ue8m0_cast=not is_deep_gemm_e8m0_used()" in cast
    assert classes.deep_gemm_e8m0() is False  # no DeepGEMM on this machine
    assert SPEC.holds() == (classes.Held.PLAIN, "")


# --- served inside vLLM's modular kernel ---------------------------------------------------------

def test_triton_calls_run_the_winner_and_deep_gemm_calls_get_what_the_prepare_step_gives(
        deep_gemm, tmp_path, cpu_sku, caplog):
    """A block-fp8 layer with N = 640: vLLM's pick gives up to 127 tokens to Triton, where the
    table's winner runs on the unquantized activations; 128 tokens go to DeepGEMM, which gets
    exactly what vLLM's prepare step would have given it though the table has a winner for that
    bucket too (it was timed against vLLM's Triton kernel, not DeepGEMM). The layer's first call,
    quantized by the prepare step before the layer attached, runs as vLLM runs it."""
    shape = shape_of(LARGE_N)
    table = write_winners(tmp_path / "t.db", shape, (1, 8, 128), "torch_grouped", sku=cpu_sku)
    state = PluginState(Settings(table=table))
    assert hook.install(state, classes.CUDA_SPECS) == ["TritonExperts", "TritonOrDeepGemmExperts"]
    experts, config, forward = served_layer(state, LARGE_N)
    with caplog.at_level(logging.INFO, logger="moetune"):
        x, _, _ = forward(128, seed=1)  # quantized by vLLM's prepare step, then the layer attaches
    (dg, first), = deep_gemm
    assert dg is experts.experts
    assert_quantized_as_prepared(first, x, config)
    assert experts.expects_unquantized_inputs  # switched for the calls that follow
    assert not experts.fallback_experts.expects_unquantized_inputs  # the inner one is vLLM's
    line = next(r.getMessage() for r in caplog.records if "TritonOrDeepGemmExperts" in
                r.getMessage())
    assert "vLLM holds plain weights" in line and "counted as delegated" in line
    for m in (1, 8):
        _, out, want = forward(m, seed=m)
        assert (out.float() - want).norm() < 1e-2 * want.norm()  # bfloat16 rounding only
    assert len(deep_gemm) == 1
    x, _, _ = forward(128, seed=2)  # unquantized to the hook now: it quantizes for DeepGEMM
    (dg, call), = deep_gemm[1:]
    assert dg is experts.experts and call.topk_ids.shape == (128, TOPK)
    assert_quantized_as_prepared(call, x, config)
    assert state.counts == {shape.problem(1).describe().removeprefix("M=1 "): {
        "hit": 2, "miss": 0, "fallback": 1, "delegated": 1}}
    inner = experts.fallback_experts
    assert hook._ATTR not in inner.__dict__ and inner.__dict__[hook._OWNED] is True
    assert state.layers == 1


def test_vllms_triton_kernel_gets_quantized_activations_and_the_inner_object_counts_nothing(
        deep_gemm, triton_kernel, tmp_path, cpu_sku):
    """N = 128 (always Triton's): the first call (quantized by the prepare step) goes through
    vLLM's own ``FallbackExperts.apply`` to the inner, hooked ``TritonExperts``, which attaches
    nothing of its own; later, the bucket where vLLM's Triton kernel is the table's winner gets
    the activations quantized as the prepare step would have (vLLM's Triton kernel records)."""
    shape = shape_of(SMALL_N)
    rule = rule_choice(shape.problem(64), cpu_sku)
    table = write_winners(tmp_path / "t.db", shape, (1,), "torch_grouped", sku=cpu_sku)
    write_winners(table, shape, (64,), rule.kernel, rule.params, sku=cpu_sku)
    state = PluginState(Settings(table=table))
    hook.install(state, classes.CUDA_SPECS)
    experts, config, forward = served_layer(state, SMALL_N)
    inner = experts.fallback_experts
    x, _, _ = forward(1, seed=1)
    (who, first, deferring), = triton_kernel
    assert who is inner and not deferring and first.a1q_scale is not None
    assert_quantized_as_prepared(first, x, config)
    assert hook._ATTR not in inner.__dict__ and inner.__dict__[hook._OWNED] is True
    _, out, want = forward(1, seed=2)
    assert (out.float() - want).norm() < 1e-2 * want.norm() and len(triton_kernel) == 1
    x, out, _ = forward(64, seed=3)
    (who, call, deferring), = triton_kernel[1:]
    assert who is inner and not deferring and not out.any()
    assert_quantized_as_prepared(call, x, config)
    assert not deep_gemm and state.layers == 1 and hook._ATTR not in inner.__dict__
    assert next(iter(state.counts.values())) == {"hit": 2, "miss": 0, "fallback": 1,
                                                 "delegated": 0}


def test_layers_without_a_moetune_kernel_keep_vllms_quantization(deep_gemm, tmp_path, cpu_sku):
    """Where the table runs no moetune kernel, nothing is switched: DeepGEMM's calls are vLLM's,
    quantized by its prepare step, and counted as delegated; no table row is a miss there."""
    shape = shape_of(LARGE_N)
    rule = rule_choice(shape.problem(1), cpu_sku)
    table = write_winners(tmp_path / "t.db", shape, (1,), rule.kernel, rule.params, sku=cpu_sku)
    state = PluginState(Settings(table=table))
    hook.install(state, classes.CUDA_SPECS)
    experts, config, forward = served_layer(state, LARGE_N)
    for seed in (1, 2):
        x, _, _ = forward(256, seed=seed)
        assert_quantized_as_prepared(deep_gemm[-1][1], x, config)
    assert not experts.expects_unquantized_inputs
    assert next(iter(state.counts.values())) == {"hit": 0, "miss": 0, "fallback": 0,
                                                 "delegated": 2}


def test_e8m0_layers_are_left_to_deep_gemm_saying_why(deep_gemm, monkeypatch, tmp_path, cpu_sku,
                                                      caplog):
    """With DeepGEMM's E8M0 scales (vLLM's default wherever DeepGEMM runs) vLLM requantized the
    weights at load and picks DeepGEMM for every call: the layer is not moetune's, the startup
    line says why, and its calls run DeepGEMM as vLLM quantized them, counted as delegated."""
    from vllm.utils import deep_gemm as vllm_deep_gemm

    monkeypatch.setattr(vllm_deep_gemm, "is_deep_gemm_e8m0_used", lambda: True)
    monkeypatch.setattr(triton_deep_gemm_moe, "is_deep_gemm_e8m0_used", lambda: True)
    assert SPEC.holds()[0] is classes.Held.DEEP_GEMM_E8M0
    shape = shape_of(SMALL_N)
    table = write_winners(tmp_path / "t.db", shape, (1, 8), "torch_grouped", sku=cpu_sku)
    state = PluginState(Settings(table=table))
    hook.install(state, classes.CUDA_SPECS)
    experts, config, forward = served_layer(state, SMALL_N)
    with caplog.at_level(logging.INFO, logger="moetune"):
        for m in (1, 8):
            x, _, _ = forward(m, seed=m)
            assert_quantized_as_prepared(deep_gemm[-1][1], x, config)
    assert not experts.expects_unquantized_inputs and len(deep_gemm) == 2
    (label, counts), = state.counts.items()
    assert label == f"not handled: {SPEC.holds()[1]}" and "E8M0" in label
    assert counts == {"hit": 0, "miss": 0, "fallback": 0, "delegated": 2}
    line = next(r.getMessage() for r in caplog.records if "TritonOrDeepGemmExperts" in
                r.getMessage())
    assert "DeepGEMM-requantized" in line and "E8M0" in line


def test_the_hooks_quantization_is_the_prepare_steps(deep_gemm):
    """``quant.quantize_input`` passes the prepare step's arguments to vLLM's function."""
    config, _ = fp8_block_layer(SMALL_N)
    x = torch.randn(5, H, dtype=torch.bfloat16)
    a1q, scale = quantize_input(config, x)
    want = prepared(x, config)
    assert torch.equal(a1q.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(scale, want[1])
