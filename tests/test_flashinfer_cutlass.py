"""``flashinfer_cutlass``: FlashInfer's CUTLASS fused MoE, declared and called as vLLM calls it.

FlashInfer is not installed here (the GPU machine gets it with ``--flashinfer``), so the kernel
is ineligible with the reason, and its call runs against a stand-in ``flashinfer.fused_moe``
whose ``cutlass_fused_moe`` has the real function's parameters (``SIGNATURE``, read from the
0.7.2.post1 wheel's ``flashinfer/fused_moe/core.py``; checked against a real FlashInfer where
one is installed or named by ``MOETUNE_FLASHINFER_WHEEL``) and computes what FlashInfer's
``Swiglu`` does on w31 weights (up rows, then gate rows). The weight layout is vLLM's own
``swap_w13_to_w31``, and the arguments are the ones ``FlashInferExperts.apply`` passes.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import importlib.util
import inspect
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from moetune.runtime.kernels.base import WeightLayout
from moetune.runtime.kernels.flashinfer_cutlass import MIN_BLOCK_SCALE, to_w31
from moetune.runtime.kernels.quant import dequantize_fp8
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.registry import default_registry
from moetune.tuner.gate import relative_error, tolerance
from moetune.tuner.inputs import make_batch, make_weights

KERNEL = default_registry.get("flashinfer_cutlass")
H100 = SKU(Vendor.NVIDIA, "H100", "sm_90", 132, 80)
#: ``flashinfer.fused_moe.cutlass_fused_moe``'s parameters in flashinfer-python 0.7.2.post1
#: (keyword-only ones after ``workspace_buffer``).
SIGNATURE = (
    "input", "token_selected_experts", "token_final_scales", "fc1_expert_weights",
    "fc2_expert_weights", "output_dtype", "quant_scales", "fc1_expert_biases",
    "fc2_expert_biases", "input_sf", "swiglu_alpha", "swiglu_beta", "swiglu_limit", "tp_size",
    "tp_rank", "ep_size", "ep_rank", "cluster_size", "cluster_rank", "output",
    "enable_alltoall", "use_deepseek_fp8_block_scale", "use_w4_group_scaling",
    "use_mxfp8_act_scaling", "min_latency_mode", "use_packed_weights", "use_wfp4afp8_humming",
    "tune_max_num_tokens", "enable_pdl", "activation_type", "swizzled_input_sf",
    "use_fused_finalize", "profile_ids", "workspace_buffer", "clamped_relu2_limit",
    "situ_beta", "situ_linear_beta", "backend")
REQUIRED = SIGNATURE[:7]


def _real_source(path: str = "fused_moe/core.py") -> str | None:
    """A source file of an installed FlashInfer or the named wheel (``path`` in the package)."""
    wheel = os.environ.get("MOETUNE_FLASHINFER_WHEEL")
    if wheel and Path(wheel).exists():
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(f"flashinfer/{path}").decode()
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return (Path(spec.submodule_search_locations[0]) / path).read_text()


@pytest.mark.skipif(_real_source() is None, reason="no FlashInfer installed or named by "
                    "MOETUNE_FLASHINFER_WHEEL (the 0.7.2.post1 wheel, 62 MB)")
def test_the_signature_is_flashinfers():
    tree = ast.parse(_real_source())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name == "cutlass_fused_moe")
    args = fn.args
    assert tuple(a.arg for a in args.args + args.kwonlyargs) == SIGNATURE
    assert len(args.args) - len(args.defaults) == len(REQUIRED)


@pytest.mark.skipif(_real_source("autotuner/autotuner.py") is None, reason="no FlashInfer "
                    "installed or named by MOETUNE_FLASHINFER_WHEEL (the 0.7.2.post1 wheel, 62 MB)")
def test_the_autotuner_is_flashinfers():
    """``autotune(True)``, as the kernel calls it, is FlashInfer's context: tune mode first."""
    tree = ast.parse(_real_source("autotuner/autotuner.py"))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "autotune")
    assert [a.arg for a in fn.args.args][:1] == ["tune_mode"]
    init = _real_source("autotuner/__init__.py")
    assert "autotune," in init


def test_without_flashinfer_the_kernel_says_so():
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("FlashInfer is installed here")
    problem = MoEProblem(256, 7168, 256, 256, 8, "bfloat16", QuantScheme.FP8_BLOCK_128X128)
    assert KERNEL.supports(problem, H100) == (False, "flashinfer_cutlass: flashinfer is not "
                                                     "installed")
    assert KERNEL.layout is WeightLayout.FLASHINFER_W31


def test_capabilities_where_flashinfer_is_there(monkeypatch):
    """With FlashInfer importable: block fp8 on sm_90 only (its block-scale path raises
    elsewhere), unquantized from sm_90 on, the router weight on the output only."""
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flashinfer" else None)
    block = MoEProblem(256, 7168, 256, 256, 8, "bfloat16", QuantScheme.FP8_BLOCK_128X128)
    assert KERNEL.supports(block, H100) == (True, None)
    b200 = SKU(Vendor.NVIDIA, "B200", "sm_100", 148, 180)
    assert "sm_90 only" in KERNEL.supports(block, b200)[1]
    assert KERNEL.supports(MoEProblem(64, 2048, 768, 128, 8, "bfloat16"), b200) == (True, None)
    assert "sm_90 or newer" in KERNEL.supports(block, SKU(Vendor.NVIDIA, "A100", "sm_80", 108,
                                                          80))[1]
    on_input = MoEProblem(8, 2048, 768, 128, 1, "bfloat16", router_weight_on_input=True)
    assert "router weight on the input" in KERNEL.supports(on_input, H100)[1]
    assert "per_tensor" in KERNEL.supports(
        MoEProblem(8, 2048, 768, 128, 8, "bfloat16", "fp8_per_tensor"), H100)[1]


def test_the_layout_is_vllms_swap():
    pytest.importorskip("vllm.model_executor.layers.fused_moe", reason="vLLM is not installed")
    from vllm.model_executor.layers.quantization.utils import flashinfer_utils as vllm
    w = torch.randn(3, 8, 5)
    assert torch.equal(to_w31(w), vllm.swap_w13_to_w31(w))
    s = torch.rand(3, 4, 2)  # block scales: rows of blocks
    assert torch.equal(to_w31(s), vllm.swap_w13_to_w31(s))
    source = inspect.getsource(vllm.prepare_fp8_moe_layer_for_fi)
    assert "_FI_CUTLASS_MIN_BLOCK_SCALE = 1e-10" in source and MIN_BLOCK_SCALE == 1e-10


class _ActivationType(enum.IntEnum):
    Swiglu = 3  # FlashInfer's value (``tllm_enums.ActivationType``)


@pytest.fixture
def stand_in(monkeypatch):
    """``flashinfer.fused_moe`` with a ``cutlass_fused_moe`` of the real parameters that computes
    gated SiLU on w31 weights, unquantized or block fp8 (scales of w31 rows), as FlashInfer does,
    and records its keyword arguments."""
    calls = []

    def cutlass_fused_moe(*args, **kwargs):
        bound = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                     default=None if n not in REQUIRED else
                                                     inspect.Parameter.empty)
                                   for n in SIGNATURE]).bind(*args, **kwargs)
        calls.append(bound.arguments)
        a = bound.arguments
        w13, w2 = a["fc1_expert_weights"], a["fc2_expert_weights"]
        if a.get("use_deepseek_fp8_block_scale"):
            w13 = dequantize_fp8(w13, a["quant_scales"][0], QuantScheme.FP8_BLOCK_128X128)
            w2 = dequantize_fp8(w2, a["quant_scales"][1], QuantScheme.FP8_BLOCK_128X128)
        x = a["input"].float()
        out = torch.zeros_like(x)
        inter = w13.shape[1] // 2
        for t, (ids, ws) in enumerate(zip(a["token_selected_experts"].tolist(),
                                          a["token_final_scales"])):
            for e, weight in zip(ids, ws):
                h = x[t] @ w13[e].float().T
                up, gate = h[:inter], h[inter:]
                out[t] += weight * ((torch.nn.functional.silu(gate) * up) @ w2[e].float().T)
        result = out.to(a["output_dtype"])
        return a["output"].copy_(result) if a.get("output") is not None else result

    tuning = []

    @contextlib.contextmanager
    def autotune(tune_mode: bool = True, *args, **kwargs):
        tuning.append(tune_mode)
        try:
            yield
        finally:
            tuning.pop()

    def tuned_call(*args, **kwargs):
        result = cutlass_fused_moe(*args, **kwargs)
        calls[-1]["under autotune"] = list(tuning)
        return result

    fused_moe = types.ModuleType("flashinfer.fused_moe")
    fused_moe.cutlass_fused_moe = tuned_call
    fused_moe.ActivationType = _ActivationType
    autotuner = types.ModuleType("flashinfer.autotuner")
    autotuner.autotune = autotune
    package = types.ModuleType("flashinfer")
    package.fused_moe, package.autotuner = fused_moe, autotuner
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fused_moe)
    monkeypatch.setitem(sys.modules, "flashinfer.autotuner", autotuner)
    return calls


@pytest.mark.parametrize("quant", [QuantScheme.NONE, QuantScheme.FP8_BLOCK_128X128])
def test_the_call_is_vllms_and_computes_the_layer(quant, stand_in):
    """The arguments ``FlashInferExperts.apply`` passes for these schemes, on w31 weights whose
    scales moved with their rows: the stand-in's SwiGLU then matches the float32 reference."""
    problem = MoEProblem(5, 256, 128, 4, 2, "bfloat16", quant)
    weights = make_weights(problem, "cpu", seed=1)
    batch = make_batch(problem, "cpu", seed=2)
    fn = KERNEL.prepare(problem, {}, weights)
    want = default_registry.get("reference").prepare(problem, {}, weights)(*batch.args())
    got = fn(*batch.args())
    assert relative_error(got, want) <= tolerance(problem, "cpu")
    out = torch.full_like(batch.x, float("nan"))
    assert fn(*batch.args(), out=out) is out and relative_error(out, want) <= tolerance(
        problem, "cpu")
    call = stand_in[0]
    block = quant is QuantScheme.FP8_BLOCK_128X128
    assert call["use_deepseek_fp8_block_scale"] is block
    assert call["activation_type"] == _ActivationType.Swiglu
    assert call["token_selected_experts"].dtype == torch.int32
    assert call["input"] is batch.x  # unquantized: FlashInfer quantizes block fp8 itself
    assert len(call["quant_scales"]) == (2 if block else 0)
    assert "input_sf" not in call  # vLLM passes None: FlashInfer's default
    # The first call picks FlashInfer's tactics under its autotuner, as vLLM's warm-up does;
    # the rest use them.
    assert [c["under autotune"] for c in stand_in] == [[True], []]


def test_vllms_call_uses_the_same_parameters():
    """Every keyword ``FlashInferExperts.apply`` passes is one of the real function's, and the
    kernel passes a subset of vLLM's (the rest are vLLM's defaults for these schemes: no
    biases, no SwiGLU limits, TP/EP of one rank, ``input_sf`` None)."""
    pytest.importorskip("vllm.model_executor.layers.fused_moe", reason="vLLM is not installed")
    from vllm.model_executor.layers.fused_moe.experts import flashinfer_cutlass_moe

    def keywords(source: str, callee: str) -> set[str]:
        tree = ast.parse(inspect.cleandoc("\n" + source) if source[0] == " " else source)
        return {k.arg for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == callee for k in n.keywords}

    theirs = keywords(inspect.getsource(flashinfer_cutlass_moe.FlashInferExperts.apply),
                      "flashinfer_cutlass_fused_moe")
    ours = keywords(inspect.getsource(KERNEL.prepare), "cutlass_fused_moe")
    assert theirs <= set(SIGNATURE) and ours <= theirs and len(ours) == 10
