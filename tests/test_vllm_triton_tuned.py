"""``vllm_triton_tuned``: vLLM's own Triton MoE path with a searched config, set through vLLM's
public ``override_config``, against each supported vLLM release.

On the CPU: vLLM's override behaves as the family relies on (in every release's sources); the
family is ineligible, saying why, and the rule stays ``vllm_triton`` with ``{}``; run through
vLLM's real ``TritonExperts.apply`` with its launches recorded (``tests/vllm_launches.py``),
the family hands both launches its config and leaves vLLM's configs as they were; served by the
plugin, a table winner of the family is the layer's own ``apply`` inside the override (no
second modular kernel, no re-entry into the hooked ``apply``), and ``lookup`` says so. On an
NVIDIA GPU with vLLM's compiled ops: at vLLM's own pick it computes what ``vllm_triton`` does,
and at another config what the reference does.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from moetune.runtime.kernels.triton_config import vllm_config
from moetune.runtime.kernels.vllm_triton import VllmTritonKernel, VllmTritonTunedKernel
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem, QuantScheme, Shape
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import is_rule_pick, rule_choice
from moetune.runtime.vllm import triton as vllm_triton_mod
from moetune.runtime.vllm.versions import installed_facts
from tests.vllm_launches import as_h200, record_launches

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (bash scripts/setup.sh --vllm)", allow_module_level=True)

import vllm.model_executor.layers.fused_moe as vllm_fused_moe  # noqa: E402
from vllm.model_executor.layers.fused_moe import fused_moe  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts import triton_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_workspace")
H100 = SKU(Vendor.NVIDIA, "H100 80GB HBM3", "sm_90", 132, 80 << 30)
HAS_CUDA_PATH = torch.cuda.is_available() and vllm_triton_mod.vllm_triton()[0] is not None
#: Not vLLM's default for any size: GEMM tiles and warps of their own.
OTHER = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16,
         "num_warps": 8, "num_stages": 3}
SMALL = MoEProblem(8, 256, 128, 8, 2, "bfloat16")


# --- vLLM's override, in every supported release --------------------------------------------
def test_vllms_override_is_what_every_launch_config_lookup_returns(monkeypatch):
    """``override_config``/``get_config`` are public in the release under test, and vLLM's
    config lookup (``try_get_optimal_moe_config``, which ``TritonExperts.apply`` calls) returns
    the override before any tuned file or default; outside it, vLLM's pick again."""
    assert {"override_config", "get_config"} <= set(vllm_fused_moe.__all__)
    as_h200(monkeypatch)
    w1, w2 = (8, 256, 256), (8, 256, 128)
    before = fused_moe.try_get_optimal_moe_config(w1, w2, 2, None, 8)
    assert OTHER != before and vllm_fused_moe.get_config() is None
    with vllm_triton_mod.config_override(OTHER):
        assert vllm_fused_moe.get_config() == OTHER
        assert fused_moe.try_get_optimal_moe_config(w1, w2, 2, None, 8) == OTHER
        assert fused_moe.try_get_optimal_moe_config(w1, w2, 2, "fp8_w8a8", 4096,
                                                     block_shape=[128, 128]) == OTHER
    assert vllm_fused_moe.get_config() is None
    assert fused_moe.try_get_optimal_moe_config(w1, w2, 2, None, 8) == before


def test_a_launch_that_raises_under_the_override_leaves_vllms_configs_as_they_were():
    """vLLM's own ``override_config`` has no ``finally``: an exception in its body would
    leave the override set for every later layer. Ours restores it."""
    with pytest.raises(RuntimeError, match="launch"):
        with vllm_triton_mod.config_override(OTHER):
            raise RuntimeError("launch failed")
    assert vllm_fused_moe.get_config() is None


def test_under_an_override_vllm_reads_no_down_config_in_the_releases_that_read_one():
    """``VllmFacts.down_configs``: 0.34's ``TritonExperts.apply`` reads GEMM2's ``_down.json``
    only without an override (``not get_config()``); earlier releases read none."""
    source = inspect.getsource(triton_moe.TritonExperts.apply)
    reads_down = "down_moe=True" in source
    assert reads_down == installed_facts().down_configs
    assert ("not get_config()" in source) == reads_down


# --- the family ---------------------------------------------------------------------------
def test_on_the_cpu_the_family_says_why_it_cannot_run():
    ok, why = VllmTritonTunedKernel.supports(SMALL, H100)
    if torch.cuda.is_available():
        pytest.skip("checks the CPU's refusal")
    assert not ok and why.startswith("vllm_triton_tuned: ") and "needs CUDA" in why
    assert default_registry.get("vllm_triton_tuned") is VllmTritonTunedKernel


def _eligible(monkeypatch) -> None:
    """vLLM's Triton path as on a CUDA host with vLLM's compiled ops."""
    for kernel in (VllmTritonKernel, VllmTritonTunedKernel):
        monkeypatch.setattr(kernel, "_supports_device",
                            classmethod(lambda cls, problem, sku: None))


@pytest.mark.parametrize("quant", [QuantScheme.NONE, QuantScheme.FP8_BLOCK_128X128])
def test_the_family_starts_at_vllms_pick_and_the_rule_stays_vllms_own(quant, monkeypatch):
    """Its seed is vLLM's config for the problem (the tuned file's entry, else the default),
    a point of its space; the rule's pick is still ``vllm_triton`` with ``{}``, and the family
    at vLLM's config is not the rule's pick (it is timed against it)."""
    _eligible(monkeypatch)
    problem = MoEProblem(64, 7168, 256, 256, 8, "bfloat16", quant)
    seed = VllmTritonTunedKernel.seed_params(problem, H100)
    assert seed == vllm_config(problem, H100)[0]
    assert VllmTritonTunedKernel.validate(seed) == seed
    assert VllmTritonTunedKernel.check_params(problem, seed) is None
    rule = rule_choice(problem, H100)
    assert (rule.kernel, rule.params) == ("vllm_triton", {})
    assert is_rule_pick("vllm_triton", {}, problem, H100)
    assert not is_rule_pick("vllm_triton_tuned", seed, problem, H100)
    assert "vllm_triton_tuned" in [k.name for k in default_registry.candidates(problem, H100)]


def test_the_family_speaks_vllms_config_space_both_ways():
    """One config for both GEMMs: another family's best becomes this family's start only
    where its two GEMMs share a config (the search's ``translations``)."""
    from moetune.tuner.measure import Result, Status
    from moetune.tuner.search import translations

    kernel = VllmTritonTunedKernel
    assert kernel.gemm_configs(SMALL, OTHER) == (OTHER, OTHER)
    assert kernel.from_gemm_configs(SMALL, OTHER, OTHER) == OTHER
    assert kernel.from_gemm_configs(SMALL, OTHER, {**OTHER, "num_warps": 4}) is None
    kernels = {k.name: default_registry.get(k.name) for k in (
        default_registry.get("aiter_triton"), default_registry.get("aiter_triton_split"),
        kernel)}
    best = Result("aiter_triton", OTHER, Status.OK)
    moved = {k.name: p for k, p in translations(SMALL, kernels, best)}
    assert moved["vllm_triton_tuned"] == OTHER
    split = {"g1_" + k: v for k, v in OTHER.items()} | {"g2_" + k: v for k, v in OTHER.items()}
    split["g2_num_warps"] = 4
    assert "vllm_triton_tuned" not in {
        k.name for k, _ in translations(SMALL, kernels, Result("aiter_triton_split", split,
                                                               Status.OK))}
    # A tile too big for Hopper's shared memory is pruned before it runs.
    huge = {**OTHER, "BLOCK_SIZE_M": 256, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 256,
            "num_stages": 5}
    assert "shared memory" in kernel.check_params(SMALL, huge)


def test_the_search_measures_the_family_at_vllms_pick_and_climbs_it(monkeypatch):
    """On a CUDA host the family is a candidate of every bucket: measured at its seed (vLLM's
    pick) among the starts, and climbed from its best when it wins."""
    from moetune.tuner.measure import Result, Status
    from moetune.tuner.search import search
    from moetune.tuner.timing import Timing

    _eligible(monkeypatch)
    problem = MoEProblem(64, 256, 128, 8, 2, "bfloat16")
    seed = VllmTritonTunedKernel.seed_params(problem, H100)
    better = {**seed, "num_warps": 8}
    calls = []

    class Measurer:
        def measure(self, kernel, params, cutoff_us=None):
            calls.append((kernel, params))
            us = (90.0 if params == better else 100.0) if kernel == "vllm_triton_tuned" else 120.0
            return Result(kernel, params, Status.OK, Timing(us, us, us, 1, "formula"))

    candidates = [default_registry.get(n) for n in ("vllm_triton", "vllm_triton_tuned",
                                                    "torch_loop")]
    results = search(problem, H100, Measurer(), candidates, trials=3, refine=20)
    tuned = [p for k, p in calls if k == "vllm_triton_tuned"]
    assert tuned[0] == seed and calls[0] == ("vllm_triton", {})
    best = min(results.values(), key=lambda r: r.median_us)
    assert (best.kernel, best.params) == ("vllm_triton_tuned", better)


# --- vLLM's apply with its launches recorded (the installed vLLM's compiled activation op) --
def _inputs(problem: MoEProblem) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    m, e = problem.num_tokens, problem.num_experts
    ids = torch.stack([torch.randperm(e)[:problem.topk] for _ in range(m)]).int()
    return torch.randn(m, problem.hidden_size, dtype=torch.bfloat16), torch.rand(m, 2), ids


def _weights(problem: MoEProblem) -> tuple[torch.Tensor, torch.Tensor]:
    e, h, i = problem.num_experts, problem.hidden_size, problem.intermediate_size
    return (torch.zeros(e, 2 * i, h, dtype=torch.bfloat16),
            torch.zeros(e, h, i, dtype=torch.bfloat16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the launches a CPU cannot run")
def test_the_family_hands_vllms_launches_its_config_for_both_gemms(monkeypatch):
    from moetune.runtime.kernels.base import MoEWeights

    launched = record_launches(monkeypatch)
    as_h200(monkeypatch)
    w13, w2 = _weights(SMALL)
    fn = VllmTritonTunedKernel.prepare(SMALL, OTHER, MoEWeights(w13, w2))
    out = torch.full((SMALL.num_tokens, SMALL.hidden_size), 7.0, dtype=torch.bfloat16)
    assert fn(*_inputs(SMALL), out=out) is out and not out.any()
    assert launched == [OTHER, OTHER]
    assert vllm_fused_moe.get_config() is None
    launched.clear()
    VllmTritonKernel.prepare(SMALL, {}, MoEWeights(w13, w2))(*_inputs(SMALL))
    pick = vllm_triton_mod.config_choice(SMALL)[0]
    assert launched == [pick, pick] and pick != OTHER  # vLLM's own again, outside the override


# --- served by the plugin -----------------------------------------------------------------
@pytest.fixture
def hooked_triton(monkeypatch, tmp_path, cpu_sku, plugin_serves_cpu):
    """vLLM's real ``TritonExperts`` (its launches recorded; a launch at ``OTHER``'s tiles can
    be made to fail) hooked by the plugin with a table whose winner at M=1 and 8 is the family
    at ``OTHER`` and at M=64 the rule's pick; unhooked after the test."""
    from moetune.runtime.vllm.classes import DEFER_PROPERTY, TRITON
    from moetune.serving import hook
    from moetune.serving.settings import Settings
    from moetune.serving.state import PluginState
    from tests.vllm_tables import write_winners

    fails = []
    launched = record_launches(monkeypatch, fail=lambda c: fails and c["num_warps"] == 8)
    _eligible(monkeypatch)
    cls = TRITON.load()
    monkeypatch.setattr(cls, "apply", cls.__dict__["apply"])  # restored after the test
    monkeypatch.setattr(cls, DEFER_PROPERTY, cls.__dict__[DEFER_PROPERTY])
    shape = Shape(256, 128, 8, 2, "bfloat16", "none", "silu", True, False)
    rule = rule_choice(shape.problem(64), cpu_sku)
    table = write_winners(tmp_path / "t.db", shape, (1, 8), "vllm_triton_tuned", OTHER,
                          sku=cpu_sku)
    write_winners(table, shape, (64,), rule.kernel, rule.params, sku=cpu_sku)
    state = PluginState(Settings(table=table))
    assert hook.install(state, (TRITON,)) == ["TritonExperts"]
    code = vllm_triton_mod.vllm_code()[0]
    problem = shape.problem(1)
    experts = cls(vllm_triton_mod.moe_config(code, problem, torch.device("cpu")),
                  vllm_triton_mod.quant_config(code, problem, None, None))
    kernel = code.modular_kernel.FusedMoEKernel(
        code.no_dp_ep.MoEPrepareAndFinalizeNoDPEPModular(), experts)
    w13, w2 = _weights(problem)

    def forward(m: int) -> torch.Tensor:
        x, topk_weights, ids = _inputs(shape.problem(m))
        return kernel.apply(x, w13, w2, topk_weights, ids, code.activation("silu"), 8, None,
                            False)

    return state, launched, forward, fails, shape


def test_a_winner_of_the_family_is_served_as_vllms_own_apply_inside_the_override(
        hooked_triton):
    state, launched, forward, _, shape = hooked_triton
    assert not forward(1).any()
    assert launched == [OTHER, OTHER]  # vLLM's apply, with the winner's config for both GEMMs
    assert vllm_fused_moe.get_config() is None  # only around the launch
    launched.clear()
    forward(64)  # the rule's pick: vLLM's apply as vLLM configures it
    pick = vllm_triton_mod.config_choice(shape.problem(64))[0]
    assert launched == [pick, pick]
    launched.clear()
    forward(8)
    assert launched == [OTHER, OTHER]
    # One layer attached: the winner built no modular kernel of its own, whose hooked apply
    # would have attached another; no plain copy of the weights was kept.
    assert state.layers == 1 and state.plain_copy_bytes == 0
    assert next(iter(state.counts.values())) == {"hit": 3, "miss": 0, "fallback": 0}


def test_a_failing_override_falls_back_to_vllms_configs_for_good(hooked_triton):
    state, launched, forward, fails, shape = hooked_triton
    fails.append(True)
    forward(1)
    pick = vllm_triton_mod.config_choice(shape.problem(1))[0]
    assert launched == [OTHER, pick, pick]  # the failed launch, then vLLM's own apply again
    assert vllm_fused_moe.get_config() is None
    launched.clear()
    forward(8)  # the same winner: vLLM's configs from now on
    assert launched == [vllm_triton_mod.config_choice(shape.problem(8))[0]] * 2
    assert next(iter(state.counts.values())) == {"hit": 0, "miss": 0, "fallback": 2}


def test_lookup_says_the_winner_runs_as_vllms_own_apply(hooked_triton, cpu_sku):
    from moetune.runtime.kernels.base import WeightLayout
    from moetune.runtime.plan import ShapePlan
    from moetune.tuner.report import lookup_text

    state, _, _, _, shape = hooked_triton
    dispatcher = state.dispatcher()
    plan = ShapePlan.build(dispatcher, shape, WeightLayout.PLAIN)
    assert not plan.runs_moetune and plan.kernels() == {}
    assert list(plan.kernels(engine=True)) == [("vllm_triton_tuned", plan.choices[1].key[1])]
    text = lookup_text(shape.problem(1), dispatcher, plan)
    assert "pick:    vllm_triton_tuned" in text and "vLLM's own experts apply" in text
    assert "counted: hit" in text
    assert "M=1 vllm_triton_tuned (vLLM's apply)" in plan.summary()


# --- on the GPU ---------------------------------------------------------------------------
cuda_path = pytest.mark.skipif(not HAS_CUDA_PATH, reason="needs an NVIDIA GPU with vLLM's CUDA "
                               f"ops loaded: {vllm_triton_mod.vllm_triton()[1]}")


@pytest.mark.cuda
@cuda_path
@pytest.mark.parametrize("quant", [QuantScheme.NONE, QuantScheme.FP8_PER_CHANNEL,
                                   QuantScheme.FP8_BLOCK_128X128])
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
def test_at_vllms_pick_the_family_computes_what_vllm_triton_does(quant, num_tokens):
    """Bit for bit, unless vLLM 0.34 runs GEMM2 from its ``_down.json`` (sorted-A TMA path),
    which the override skips: then within two fp8 roundings."""
    from moetune.runtime.platform import detect_sku
    from moetune.tuner.gate import relative_error
    from moetune.tuner.inputs import make_batch, make_weights

    on_input = quant is QuantScheme.FP8_PER_CHANNEL
    problem = MoEProblem(num_tokens, 2048, 256, 64, 1 if on_input else 8, "bfloat16", quant,
                         router_weight_on_input=on_input)
    seed = VllmTritonTunedKernel.seed_params(problem, detect_sku("cuda"))
    pick, down = vllm_triton_mod.config_choice(problem)
    weights = make_weights(problem, "cuda", seed=0)
    args = make_batch(problem, "cuda", seed=1).args()
    theirs = VllmTritonKernel.prepare(problem, {}, weights)(*args)
    ours = VllmTritonTunedKernel.prepare(problem, seed, weights)(*args)
    if down is None and seed == {k: pick[k] for k in seed}:
        assert torch.equal(ours, theirs)
    else:
        assert relative_error(ours, theirs) < 3e-2


@pytest.mark.cuda
@cuda_path
@pytest.mark.parametrize("quant", [QuantScheme.NONE, QuantScheme.FP8_PER_TENSOR,
                                   QuantScheme.FP8_BLOCK_128X128])
@pytest.mark.parametrize("num_tokens", [1, 333, 2048])
def test_at_another_config_the_family_matches_the_reference(quant, num_tokens):
    from moetune.tuner.gate import relative_error
    from moetune.tuner.inputs import make_batch, make_weights

    problem = MoEProblem(num_tokens, 2048, 384, 64, 8, "bfloat16", quant)
    config = OTHER
    assert VllmTritonTunedKernel.check_params(problem, config) is None
    weights = make_weights(problem, "cuda", seed=0)
    args = make_batch(problem, "cuda", seed=1).args()
    ours = VllmTritonTunedKernel.prepare(problem, config, weights)(*args)
    reference = default_registry.get("reference").prepare(problem, {}, weights)(*args)
    assert vllm_fused_moe.get_config() is None
    assert relative_error(ours, reference) < (6e-2 if quant.is_fp8 else 2e-2)
