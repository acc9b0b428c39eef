"""The CUDA rule's pick is vLLM's own Triton MoE path (``vllm_triton``), of the installed vLLM.

On the CPU: the kernel's code is the installed vLLM's (its ``TritonExperts`` and Triton kernel
module), it is ineligible with the reason, and run through vLLM's real ``TritonExperts.apply``
(with the GPU-only launches recorded instead of run) it hands vLLM's launcher the configs
vLLM's own lookup chooses; those agree with what moetune reads from vLLM's files, ``_down.json``
included. On an NVIDIA GPU with vLLM's compiled ops: its output matches vLLM's other entry
point (``fused_experts``) and the float32 reference.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import rule_choice
from moetune.runtime.vllm import configs, triton as vllm_triton_mod
from moetune.runtime.vllm.versions import installed, installed_facts
from tests.vllm_launches import as_h200, record_launches

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (bash scripts/setup.sh --vllm)", allow_module_level=True)

from vllm.model_executor.layers.fused_moe import fused_moe  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts import triton_moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_workspace")
H200 = SKU(Vendor.NVIDIA, "H200", "sm_90", 132, 141)
HAS_CUDA_PATH = torch.cuda.is_available() and vllm_triton_mod.vllm_triton()[0] is not None


def test_the_rule_kernels_code_is_the_installed_vllms():
    code, why = vllm_triton_mod.vllm_code()
    assert code is not None, why
    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    assert code.experts is triton_moe.TritonExperts
    assert Path(code.fused_moe.__file__).is_relative_to(root)
    kernel = code.fused_moe.fused_moe_kernel  # a Triton JITFunction where vLLM sees Triton
    assert getattr(kernel, "fn", kernel).__module__ == code.fused_moe.__name__
    assert code.version == installed()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's refusal")
def test_on_the_cpu_the_rule_says_why_vllms_path_cannot_run():
    problem = MoEProblem(64, 256, 128, 8, 2)
    ok, why = default_registry.get("vllm_triton").supports(problem, H200)
    assert not ok and "needs CUDA" in why
    rule = rule_choice(problem, H200)
    assert rule.kernel == "aiter_triton" and "emulation" in rule.reason and "needs CUDA" in rule.reason


#: Shapes vLLM ships H200 files for (DeepSeek-V3 TP8's with a ``_down.json`` in 0.34), one it
#: has none for, at token counts on, between and beyond the files' entries.
SHAPES = [(8, 14336, 4096, 2, QuantScheme.NONE), (128, 768, 2048, 8, QuantScheme.NONE),
          (256, 256, 7168, 8, QuantScheme.FP8_BLOCK_128X128),
          (64, 352, 1024, 6, QuantScheme.NONE)]
NO_CHOICE = ("num_ctas", "SPLIT_K")  # the kernels' own defaults at 1: no choice


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E={s[0]},N={s[1]},{s[4].value}")
@pytest.mark.parametrize("num_tokens", [1, 100, 5000])
def test_vllms_config_choice_is_what_moetune_reads_from_its_files(shape, num_tokens,
                                                                   monkeypatch):
    """``config_choice`` (vLLM's lookup, as ``TritonExperts.apply`` calls it) against moetune's
    reading of the same files, which ``lookup`` and the emulation use; and the file names the
    rule's baseline records."""
    experts, inter, hidden, topk, quant = shape
    as_h200(monkeypatch)
    problem = MoEProblem(num_tokens, hidden, inter, experts, topk, "bfloat16", quant)
    config, down = vllm_triton_mod.config_choice(problem)
    ours = configs.tuned_config(problem, H200)
    want = ours[0] if ours else configs.vllm_default_config(problem)
    assert want == {k: v for k, v in config.items() if k not in NO_CHOICE or v != 1}
    found_down = configs.tuned_config(problem, H200, down=True)
    if installed_facts().down_configs and quant is QuantScheme.FP8_BLOCK_128X128:
        assert (down is None) == (found_down is None)
        assert down is None or down == found_down[0]
        assert (down is not None) == ("_down.json" in configs.configs_label(problem, H200))
    else:
        assert down is None
    label = configs.configs_label(problem, H200)
    assert label == "default" if ours is None else label.startswith(ours[1].name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the launches a CPU cannot run")
@pytest.mark.parametrize("num_tokens", [1, 100])
def test_the_rule_kernel_runs_vllms_experts_with_vllms_configs(num_tokens, monkeypatch):
    """The rule kernel's layer is vLLM's modular kernel with ``TritonExperts``: run on the CPU
    (vLLM's platform check passed by, its GPU-only align and sum by stand-ins, its Triton
    launches recorded), vLLM's ``apply`` hands its launcher the config vLLM's lookup picks for
    GEMM1 and GEMM2, as ``config_choice`` says."""
    launched = record_launches(monkeypatch)
    as_h200(monkeypatch)
    experts, inter, hidden, topk = 128, 768, 2048, 8
    problem = MoEProblem(num_tokens, hidden, inter, experts, topk, "bfloat16")
    w13 = torch.zeros(experts, 2 * inter, hidden, dtype=torch.bfloat16)
    w2 = torch.zeros(experts, hidden, inter, dtype=torch.bfloat16)
    run = vllm_triton_mod.layer(problem, w13, w2, None, None)
    x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts)[:topk] for _ in range(num_tokens)]).int()
    out = run(x, torch.rand(num_tokens, topk), ids)
    assert out.shape == x.shape
    config, _ = vllm_triton_mod.config_choice(problem)
    assert launched == [config, config]  # GEMM1, then GEMM2 (no TMA down path off Hopper)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA_PATH, reason="needs an NVIDIA GPU with vLLM's CUDA ops loaded: "
                    f"{vllm_triton_mod.vllm_triton()[1]}")
@pytest.mark.parametrize("quant", [QuantScheme.NONE, QuantScheme.FP8_BLOCK_128X128,
                                   QuantScheme.FP8_PER_CHANNEL])
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
def test_the_rule_kernel_matches_vllms_fused_experts_and_the_reference(quant, num_tokens):
    from vllm.model_executor.layers.fused_moe import config as vc

    from moetune.tuner.gate import relative_error
    from moetune.tuner.inputs import make_batch, make_weights

    on_input = quant is QuantScheme.FP8_PER_CHANNEL
    topk = 1 if on_input else 8
    problem = MoEProblem(num_tokens, 2048, 256, 64, topk, "bfloat16", quant,
                         router_weight_on_input=on_input)
    weights = make_weights(problem, "cuda", seed=0)
    x, topk_weights, topk_ids = make_batch(problem, "cuda", seed=1).args()
    ours = default_registry.get("vllm_triton").prepare(problem, {}, weights)(x, topk_weights,
                                                                          topk_ids)
    reference = default_registry.get("reference").prepare(problem, {}, weights)(
        x, topk_weights, topk_ids)
    code = vllm_triton_mod.vllm_triton()[0]
    qc = vllm_triton_mod.quant_config(code, problem, weights.w13_scale, weights.w2_scale)
    theirs = fused_moe.fused_experts(x, weights.w13, weights.w2, topk_weights, topk_ids,
                                     apply_router_weight_on_input=on_input, quant_config=qc)
    assert isinstance(qc, vc.FusedMoEQuantConfig)
    # Both are vLLM's kernel; fp8 block layers differ in where the activations are quantized
    # (the modular kernel's prepare step, or fused_experts' own call): two 4-bit roundings.
    assert relative_error(ours, theirs) < (3e-2 if quant is QuantScheme.FP8_BLOCK_128X128
                                           else 1e-2)
    assert relative_error(ours, reference) < (6e-2 if quant.is_fp8 else 2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA_PATH, reason="needs an NVIDIA GPU with vLLM's CUDA ops loaded: "
                    f"{vllm_triton_mod.vllm_triton()[1]}")
def test_on_the_gpu_the_rule_is_vllms_own_path_naming_its_version_and_configs():
    from moetune.runtime.platform import detect_sku

    sku = detect_sku("cuda")
    problem = MoEProblem(64, 2048, 768, 128, 8, "bfloat16")
    rule = rule_choice(problem, sku)
    assert (rule.kernel, rule.params, rule.vllm) == ("vllm_triton", {}, installed())
    assert rule.configs == configs.configs_label(problem, sku)
