"""The facts ``runtime/vllm/versions.py`` holds for the vLLM under test, checked against that
version's own sources, and what they change in serving.

``scripts/test.sh`` runs this module (with ``test_vllm_contract.py`` and
``test_vllm_fallback_experts.py``) once against the installed vLLM and once per other supported
release, with that release's Python sources first on ``PYTHONPATH``
(``scripts/vllm_sources.py``) and ``MOETUNE_VLLM_UNDER_TEST`` naming it: every fact is asserted
both ways, so a release that adds, drops or renames one fails here until ``FACTS`` says so.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh --vllm)")

from vllm.model_executor.layers.fused_moe import config as vllm_config  # noqa: E402
from vllm.model_executor.layers.fused_moe import fused_moe, modular_kernel  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts import rocm_aiter_moe, triton_moe  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize import no_dp_ep  # noqa: E402

from moetune.runtime.kernels.base import MoEWeights  # noqa: E402
from moetune.runtime.kernels.triton_config import vllm_config as moetune_vllm_config  # noqa: E402
from moetune.runtime.platform import SKU, Vendor  # noqa: E402
from moetune.runtime.problem import MoEProblem, QuantScheme, Shape  # noqa: E402
from moetune.runtime.registry import default_registry  # noqa: E402
from moetune.runtime.vllm import configs, versions  # noqa: E402
from moetune.runtime.vllm.classes import TRITON  # noqa: E402
from moetune.serving import hook  # noqa: E402
from moetune.runtime.kernels._routes import routable  # noqa: E402
from moetune.serving.describe import describe  # noqa: E402
from moetune.serving.layer import unpadded  # noqa: E402
from moetune.serving.settings import Settings  # noqa: E402
from moetune.serving.state import PluginState  # noqa: E402

from tests.vllm_tables import write_winners  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_workspace")
FACTS = versions.facts_of(versions.installed())
H200 = SKU(Vendor.NVIDIA, "H200", "sm_90", 132, 141)
H, I, E, TOPK = 128, 64, 4, 2
#: Every fact any supported version has, to assert each version has exactly its own.
EVERY_HOOK = sorted({h for f in versions.FACTS.values() for h in f.finalize_hooks})


def test_the_vllm_under_test_is_the_one_named_and_supported():
    want = os.environ.get("MOETUNE_VLLM_UNDER_TEST")
    if want:  # a PYTHONPATH that missed would test the installed vLLM again
        assert versions.installed() == want
    assert FACTS is not None, versions.unsupported(versions.installed())


def test_the_vllm_extra_pins_exactly_the_supported_releases():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    pin = project["project"]["optional-dependencies"]["vllm"]
    assert pin == [f"vllm{versions.supported_range().replace(' ', '')}"]


def test_padded_rows_fact_is_tritons_activation_format():
    formats = modular_kernel.FusedMoEActivationFormat
    declared = triton_moe.TritonExperts.activation_format()
    assert FACTS.padded_rows == (declared is getattr(formats, "PaddedStandard", None))


@pytest.mark.parametrize("name", EVERY_HOOK)
def test_finalize_hooks_exist_exactly_in_the_versions_that_list_them(name):
    assert hasattr(triton_moe.TritonExperts, name) == (name in FACTS.finalize_hooks)


def test_aiter_classes_are_the_concrete_ones_vllm_has():
    concrete = {n for n, c in vars(rocm_aiter_moe).items()
                if inspect.isclass(c) and issubclass(c, rocm_aiter_moe.AiterExperts)
                and not inspect.isabstract(c)}
    # mxfp4 layers are not a moetune quant scheme: vLLM's own kernel serves them unhooked.
    assert concrete - {"AiterMxfp4Experts"} == set(FACTS.aiter_experts)


def test_down_configs_fact_is_vllms_config_lookup():
    takes_down = "down_moe" in inspect.signature(fused_moe.get_moe_configs).parameters
    assert takes_down == FACTS.down_configs


def test_the_hook_quantizes_with_the_prepare_steps_own_function():
    params = tuple(inspect.signature(no_dp_ep._quantize_input).parameters)
    assert params == ("a1", "quant_config", "defer_input_quant")


#: Shapes vLLM ships H200 files for (one of them with a ``_down.json`` in 0.34) and one it does
#: not, at token counts on, between and beyond the files' entries.
SHAPES = [(8, 14336, 4096, 2, QuantScheme.NONE), (128, 768, 2048, 8, QuantScheme.NONE),
          (256, 256, 7168, 8, QuantScheme.FP8_BLOCK_128X128),
          (64, 352, 1024, 6, QuantScheme.NONE)]


NO_CHOICE = ("num_ctas", "SPLIT_K")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E={s[0]},N={s[1]},{s[4].value}")
@pytest.mark.parametrize("num_tokens", [1, 7, 100, 1536, 5000])
def test_moetunes_config_lookup_is_vllms(shape, num_tokens, monkeypatch):
    """The config the CUDA rule times is the one this vLLM's ``try_get_optimal_moe_config``
    returns on an H200, and GEMM2's ``_down.json`` entry is its ``get_moe_configs``'s."""
    experts, inter, hidden, topk, quant = shape
    monkeypatch.setattr(fused_moe, "get_device_name_as_file_name", lambda *a: "NVIDIA_H200")
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    fused_moe.get_moe_configs.cache_clear()
    problem = MoEProblem(num_tokens, hidden, inter, experts, topk, "bfloat16", quant)
    dtype, block = configs.selectors(problem)
    block_shape = list(block) if block else None
    theirs = fused_moe.try_get_optimal_moe_config(
        (experts, 2 * inter, hidden), (experts, hidden, inter), topk, dtype, num_tokens,
        block_shape)
    ours, _ = moetune_vllm_config(problem, H200)
    # num_ctas=1 and SPLIT_K=1 are the kernels' own defaults (one CTA, no split): no choice.
    assert ours == {k: v for k, v in theirs.items() if k not in NO_CHOICE or v != 1}
    if FACTS.down_configs:
        down = fused_moe.get_moe_configs(experts, inter, dtype, *(block or (None, None)),
                                         down_moe=True)
        found = configs.tuned_config(problem, H200, down=True)
        assert (found is None) == (not down)
        if down:
            assert found[0] == down[min(down, key=lambda m: abs(m - num_tokens))]


def test_a_down_file_is_named_as_vllm_names_it(monkeypatch):
    monkeypatch.setattr(fused_moe, "get_device_name_as_file_name", lambda *a: "NVIDIA_H200")
    name = fused_moe.get_config_file_name(256, 256, "fp8_w8a8", [128, 128])
    assert configs.config_file_name(256, 256, "NVIDIA_H200", "fp8_w8a8", (128, 128)) == name
    down = configs.config_file_name(256, 256, "NVIDIA_H200", "fp8_w8a8", (128, 128), down=True)
    assert down == name.removesuffix(".json") + "_down.json"
    assert configs.FILE_NAME.match(down)["down"] and not configs.FILE_NAME.match(name)["down"]


def moe_config(parallel: vllm_config.FusedMoEParallelConfig | None = None
               ) -> vllm_config.FusedMoEConfig:
    return vllm_config.FusedMoEConfig(
        num_experts=E, experts_per_token=TOPK, hidden_dim=H, intermediate_size=I,
        num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU, device="cpu",
        routing_method=vllm_config.RoutingMethodType.Renormalize,
        moe_parallel_config=parallel or vllm_config.FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.float32)


@pytest.fixture
def hooked_triton(tmp_path, cpu_sku, monkeypatch, plugin_serves_cpu):
    """vLLM's real ``TritonExperts`` of this version, hooked with a table whose winner for every
    bucket is moetune's ``torch_grouped`` (the hook unwrapped after the test)."""
    cls = triton_moe.TritonExperts
    monkeypatch.setattr(cls, "apply", cls.__dict__["apply"])
    monkeypatch.setattr(cls, "expects_unquantized_inputs", cls.__dict__[
        "expects_unquantized_inputs"])
    shape = Shape(H, I, E, TOPK, "float32", "none", "silu", True, False)
    table = write_winners(tmp_path / "t.db", shape, (1, 8, 64), "torch_grouped", sku=cpu_sku)
    state = PluginState(Settings(table=table))
    hook.install(state, (TRITON,))
    return cls, state


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 8


def call(experts, x, topk_weights, topk_ids, w13, w2) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    experts.apply(output=out, hidden_states=x, w1=w13, w2=w2, topk_weights=topk_weights,
                  topk_ids=topk_ids, activation=MoEActivation.SILU, global_num_experts=E,
                  expert_map=None, a1q_scale=None, a2_scale=None, workspace13=None,
                  workspace2=None, expert_tokens_meta=None, apply_router_weight_on_input=False)
    return out


def test_a_subclass_or_object_with_its_own_finalize_is_left_to_vllm(hooked_triton):
    """What vLLM 0.34's hooks change in ``apply``'s output, moetune's kernel does not compute:
    such a layer runs vLLM's own kernel, and its startup line says why."""
    if not FACTS.finalize_hooks:
        pytest.skip(f"vLLM {FACTS.label} has no finalize hooks")
    cls, state = hooked_triton
    experts = cls(moe_config(), vllm_config.FUSED_MOE_UNQUANTIZED_CONFIG)
    experts.post_gemm2_hook = lambda unfinalized, output: None
    w13, w2 = weights()
    x = torch.randn(3, H)
    topk_ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    with pytest.raises(Exception):  # vLLM's own Triton kernel ran: it cannot on a CPU
        call(experts, x, torch.rand(3, TOPK), topk_ids, w13, w2)
    layer = experts.__dict__["_moetune_layer"]
    assert layer.plan is None and "post_gemm2_hook differs" in layer.label
    assert not layer.fns and layer.counts["miss"] == 1


def routed_batch(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``m`` rows of activations, each routed to ``TOPK`` distinct experts."""
    torch.manual_seed(seed)
    x, topk_weights = torch.randn(m, H), torch.rand(m, TOPK)
    return x, topk_weights, torch.stack([torch.randperm(E)[:TOPK]
                                         for _ in range(m)]).to(torch.int32)


def modular(cls: type) -> tuple[object, object]:
    """An unquantized experts object of ``cls`` inside this vLLM's real modular kernel with its
    no-EP prepare step."""
    experts = cls(moe_config(), vllm_config.FUSED_MOE_UNQUANTIZED_CONFIG)
    return experts, modular_kernel.FusedMoEKernel(
        no_dp_ep.MoEPrepareAndFinalizeNoDPEPModular(), experts)


def test_a_padded_call_gives_what_vllms_kernel_gives(hooked_triton):
    """A call with padding rows (``topk_ids`` -1, activations garbage, as vLLM 0.34's
    ``PaddedStandard`` hands them over), through this vLLM's real modular kernel and no-EP
    prepare step: moetune's kernel gives zeros there, as vLLM's Triton kernel does (it skips such
    slots and ``moe_sum`` adds nothing for them), and in every routed row what vLLM computes
    (the reference: the sum over the row's routed slots)."""
    cls, state = hooked_triton
    experts, kernel = modular(cls)
    w13, w2 = weights()
    m = 8
    x, topk_weights, topk_ids = routed_batch(m, seed=1)
    pad = torch.tensor([False, True, False, False, True, False, False, True])
    x[pad] = float("nan")  # garbage
    topk_ids[pad] = -1
    topk_ids[0, 1] = -1  # a routed row with one slot on no expert
    kernel.apply(x[:1].nan_to_num(), w13, w2, topk_weights[:1], topk_ids[:1].clamp(min=0),
                 MoEActivation.SILU, E, None, False)  # attaches the layer (unpadded)
    layer = experts.__dict__["_moetune_layer"]
    layer.padded = True  # what ``describe.padded`` says of a PaddedStandard layer
    got = kernel.apply(x, w13, w2, topk_weights, topk_ids, MoEActivation.SILU, E, None, False)
    assert layer.counts["hit"] == 2
    assert torch.equal(got[pad], torch.zeros(int(pad.sum()), H))
    reference = default_registry.get("reference").prepare(
        Shape(H, I, E, TOPK, "float32", "none", "silu", True, False).problem(m), {},
        MoEWeights(w13, w2, QuantScheme.NONE))
    routed = topk_ids >= 0
    want = reference(x.nan_to_num(), topk_weights * routed, topk_ids.clamp(min=0))
    assert torch.allclose(got[~pad], want[~pad], atol=1e-5)
    hidden, weights_, ids = unpadded(x, topk_weights, topk_ids)
    assert torch.isfinite(hidden).all() and (ids >= 0).all() and weights_[~routed].eq(0).all()


def test_padding_ids_fact_is_the_routers():
    from vllm.model_executor.layers.fused_moe.router import fused_topk_router

    assert ("is_padding=" in inspect.getsource(fused_topk_router)) == FACTS.padding_ids


def test_rows_routed_nowhere_are_expected_exactly_while_vllm_skips_padding(monkeypatch):
    monkeypatch.delenv("VLLM_MOE_SKIP_PADDING", raising=False)
    assert versions.unrouted_rows(FACTS) == FACTS.padding_ids
    monkeypatch.setenv("VLLM_MOE_SKIP_PADDING", "0")
    assert not versions.unrouted_rows(FACTS)


def test_batch_invariance_is_read_as_vllm_reads_it_and_fixes_vllms_config(monkeypatch):
    """The plugin leaves a batch-invariant vLLM alone: under ``VLLM_BATCH_INVARIANT=1`` this
    release runs one Triton config at every batch size and reads no tuned file, which a
    per-bucket winner would break."""
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert versions.batch_invariance_aside() is None
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert versions.batch_invariance_aside() is None
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert "VLLM_BATCH_INVARIANT=1" in versions.batch_invariance_aside()
    picked = {str(fused_moe.get_default_config(m, 128, 768, 2048, 8, None)) for m in (1, 64, 4096)}
    assert len(picked) == 1
    fused_moe.get_moe_configs.cache_clear()
    try:
        assert fused_moe.get_moe_configs(8, 14336, None) is None
    finally:
        fused_moe.get_moe_configs.cache_clear()


def test_a_batch_padded_for_a_cuda_graph_gives_every_real_row_what_vllm_computes(hooked_triton):
    """vLLM pads a batch to a captured CUDA graph's size and its routers give the extra
    rows expert -1 and weight 0 (during a capture every row is such): the hook marks every
    layer of those versions, and moetune's kernel, which indexes experts by id, runs them as
    expert 0 at weight 0, leaving each real row as the reference computes it."""
    cls, state = hooked_triton
    experts, kernel = modular(cls)
    w13, w2 = weights()
    m = 8
    x, topk_weights, topk_ids = routed_batch(m, seed=2)
    kernel.apply(x[:1], w13, w2, topk_weights[:1], topk_ids[:1], MoEActivation.SILU, E, None,
                 False)  # attaches the layer
    layer = experts.__dict__["_moetune_layer"]
    assert layer.unrouted == FACTS.padding_ids and not layer.padded
    if not FACTS.padding_ids:
        return  # this version's routers never route a row nowhere
    pad = torch.arange(m) >= 5  # the padding is the batch's tail
    topk_ids[pad], topk_weights[pad] = -1, 0.0
    got = kernel.apply(x, w13, w2, topk_weights, topk_ids, MoEActivation.SILU, E, None, False)
    assert layer.counts["hit"] == 2
    reference = default_registry.get("reference").prepare(
        Shape(H, I, E, TOPK, "float32", "none", "silu", True, False).problem(m), {},
        MoEWeights(w13, w2, QuantScheme.NONE))
    want = reference(x, topk_weights, topk_ids.clamp(min=0))
    assert torch.allclose(got[~pad], want[~pad], atol=1e-5)
    weights_, ids = routable(topk_weights, topk_ids)
    assert (ids[pad] == 0).all() and (weights_[pad] == 0).all()
    assert torch.equal(ids[~pad], topk_ids[~pad]) and (topk_ids[pad] == -1).all()


def test_a_kernel_that_skips_unrouted_slots_gets_them_as_vllm_routes_them(hooked_triton,
                                                                          monkeypatch):
    """A winner declaring ``skips_unrouted`` gets vLLM's ids, -1 and all, with no launch to
    make them routable: here ``torch_grouped`` declares it, and its prepared callable records
    what it gets before running the rows vLLM routes."""
    if not FACTS.padding_ids:
        pytest.skip("this vLLM's routers never route a row nowhere")
    cls, state = hooked_triton
    grouped = default_registry.get("torch_grouped")
    monkeypatch.setattr(grouped, "skips_unrouted", True)
    seen: list[torch.Tensor] = []
    prepare = grouped.prepare

    def recording(problem, params, weights_):
        fn = prepare(problem, params, weights_)

        def run(x, topk_weights, topk_ids, out=None):
            seen.append(topk_ids)
            routed_weights, routed_ids = routable(topk_weights, topk_ids)
            return fn(x, routed_weights, routed_ids, out=out)
        return run

    monkeypatch.setattr(grouped, "prepare", recording)
    monkeypatch.setattr("moetune.serving.layer.routable", _never_routable)
    experts = cls(moe_config(), vllm_config.FUSED_MOE_UNQUANTIZED_CONFIG)
    w13, w2 = weights()
    m = 8
    x, topk_weights, topk_ids = routed_batch(m, seed=2)
    pad = torch.arange(m) >= 5
    topk_ids[pad], topk_weights[pad] = -1, 0.0
    got = call(experts, x, topk_weights, topk_ids, w13, w2)
    layer = experts.__dict__["_moetune_layer"]
    assert layer.unrouted and layer.counts["hit"] == 1
    assert len(seen) == 1 and torch.equal(seen[0], topk_ids) and (seen[0][pad] == -1).all()
    reference = default_registry.get("reference").prepare(
        Shape(H, I, E, TOPK, "float32", "none", "silu", True, False).problem(m), {},
        MoEWeights(w13, w2, QuantScheme.NONE))
    want = reference(x, topk_weights, topk_ids.clamp(min=0))
    assert torch.allclose(got[~pad], want[~pad], atol=1e-5)


def _never_routable(*args: object) -> None:
    raise AssertionError("routable ran for a kernel that skips unrouted slots")


def test_layers_behind_an_all2all_are_left_to_vllm():
    """Padding rows arrive only behind DeepEP v2, which is expert parallelism: such a layer
    holds part of the experts and is vLLM's, saying so."""
    parallel = dataclasses.replace(vllm_config.FusedMoEParallelConfig.make_no_parallel(),
                                   use_ep=True, ep_size=2, dp_size=2)
    experts = triton_moe.TritonExperts(moe_config(parallel),
                                       vllm_config.FUSED_MOE_UNQUANTIZED_CONFIG)
    w13, w2 = weights()
    shape, why = describe(experts, w13, w2, False)
    assert shape is None and "expert parallelism" in why
