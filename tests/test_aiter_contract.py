"""aiter's ROCm kernels, tested by contract on a machine without ROCm.

``import aiter`` needs HIP, so the installed aiter sources are parsed with ``ast`` instead: every
function a kernel declares in ``aiter_calls()`` must exist with every keyword it passes. Then
``prepare`` runs against a fake ``aiter`` whose functions carry those real signatures and record
each call, so a keyword the real package lacks fails here, and the keywords actually passed must
be exactly the declared ones.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib.util
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from moetune.runtime.kernels.aiter_asm_blockscale import AiterAsmBlockscaleKernel
from moetune.runtime.kernels.aiter_asm_tkw1 import AiterAsmTkw1Kernel
from moetune.runtime.kernels.aiter_fused_moe import (
    ACTIVATION_TYPES, QUANT_TYPES, AiterFusedMoeKernel)
from moetune.runtime.kernels.base import WeightLayout
from moetune.runtime.kernels.quant import quantize_weights
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import default_registry

_SPEC = importlib.util.find_spec("aiter")
if _SPEC is None or not _SPEC.submodule_search_locations:
    pytest.skip("amd-aiter is not installed", allow_module_level=True)
AITER_DIR = Path(next(iter(_SPEC.submodule_search_locations)))
ENUM_HEADER = AITER_DIR.parent / "aiter_meta" / "csrc" / "include" / "aiter_enum.h"

KERNELS = (AiterFusedMoeKernel, AiterAsmTkw1Kernel, AiterAsmBlockscaleKernel)
MI300X = SKU(Vendor.AMD, "MI300X", "gfx942", 304, 192 << 30)
MI355X = SKU(Vendor.AMD, "MI355X", "gfx950", 256, 288 << 30)
H200 = SKU(Vendor.NVIDIA, "H200", "sm_90", 132, 141 << 30)
#: The fp8 aiter's ``dtypes.fp8`` is on each arch.
DEVICE_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
_DEFAULT = object()  # stands for any default value in a parsed signature


# --- the installed aiter, read without importing it -------------------------------------------
def real_signature(module: str, function: str) -> inspect.Signature:
    """The signature of ``module.function`` as the installed source file defines it."""
    path = AITER_DIR.joinpath(*module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text(), filename=str(path))
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function),
                None)
    assert node is not None, f"{module}.{function} is not defined in {path}"
    a = node.args
    params = []
    positional = [(p, inspect.Parameter.POSITIONAL_ONLY) for p in a.posonlyargs]
    positional += [(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in a.args]
    first_default = len(positional) - len(a.defaults)
    for i, (p, kind) in enumerate(positional):
        default = _DEFAULT if i >= first_default else inspect.Parameter.empty
        params.append(inspect.Parameter(p.arg, kind, default=default))
    if a.vararg:
        params.append(inspect.Parameter(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        default = inspect.Parameter.empty if d is None else _DEFAULT
        params.append(inspect.Parameter(p.arg, inspect.Parameter.KEYWORD_ONLY, default=default))
    if a.kwarg:
        params.append(inspect.Parameter(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def real_enum(name: str) -> type[enum.Enum]:
    """An aiter enum (``ActivationType``, ``QuantType``) with the members its C++ header has."""
    if not ENUM_HEADER.exists():
        pytest.skip(f"{ENUM_HEADER} is not installed")
    body = re.search(rf"enum class {name}\s*:\s*int\s*\{{(.*?)\}};", ENUM_HEADER.read_text(), re.DOTALL)
    assert body, f"enum {name} not found in {ENUM_HEADER}"
    members = [m.split("=")[0].strip() for m in body.group(1).split(",") if m.strip()]
    return enum.Enum(name, members)


# --- a fake aiter that records calls ----------------------------------------------------------
@dataclasses.dataclass
class Call:
    module: str
    function: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def fake_function(module: str, function: str, calls: list[Call]) -> Any:
    signature = real_signature(module, function)

    def fn(*args: Any, **kwargs: Any) -> Any:
        signature.bind(*args, **kwargs)  # TypeError for a keyword the real function lacks
        calls.append(Call(module, function, args, kwargs))
        if function == "shuffle_weight":
            out = args[0].clone()
            out.is_shuffled = True
            return out
        return torch.zeros_like(args[0])

    fn.__signature__ = signature  # type: ignore[attr-defined]
    return fn


@pytest.fixture
def fake_aiter(monkeypatch):
    """Install a fake ``aiter`` (gfx942 flavour by default); returns (calls, set_arch)."""
    calls: list[Call] = []
    package = types.ModuleType("aiter")
    package.__path__ = []  # type: ignore[attr-defined]
    package.ActivationType = real_enum("ActivationType")  # type: ignore[attr-defined]
    package.QuantType = real_enum("QuantType")  # type: ignore[attr-defined]
    package.dtypes = types.SimpleNamespace(fp8=DEVICE_FP8["gfx942"])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "aiter", package)
    monkeypatch.setitem(sys.modules, "aiter.ops", types.ModuleType("aiter.ops"))
    modules: dict[str, types.ModuleType] = {}
    for kernel in KERNELS:
        for module, function, _ in kernel.aiter_calls():
            if module not in modules:
                modules[module] = types.ModuleType(module)
                monkeypatch.setitem(sys.modules, module, modules[module])
            setattr(modules[module], function, fake_function(module, function, calls))

    def set_arch(arch: str) -> None:
        package.dtypes.fp8 = DEVICE_FP8[arch]

    return calls, set_arch


# --- problems each kernel can run -------------------------------------------------------------
def problems_for(kernel: type, sku: SKU) -> list[MoEProblem]:
    """Every small problem (quant x activation x dtype x routing) ``kernel`` accepts on ``sku``."""
    out = []
    for quant in QUANT_TYPES:
        for activation in ACTIVATION_TYPES:
            for dtype in ("bfloat16", "float16"):
                for topk, on_input in ((2, False), (1, True)):
                    p = MoEProblem(8, 256, 256, 4, topk, dtype=dtype, quant=quant,
                                   activation=activation, router_weight_on_input=on_input)
                    if kernel.supports(p, sku)[0]:
                        out.append(p)
    return out


def weights_for(problem: MoEProblem):
    g = torch.Generator().manual_seed(0)
    e, h, i = problem.num_experts, problem.hidden_size, problem.intermediate_size
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    weights = quantize_weights(w13, w2, problem.quant)
    if not problem.quant.is_fp8:
        weights.w13, weights.w2 = (w.to(getattr(torch, problem.dtype.value))
                                   for w in (weights.w13, weights.w2))
    return weights


def routed_batch(problem: MoEProblem):
    x = torch.randn(problem.num_tokens, problem.hidden_size).to(getattr(torch, problem.dtype.value))
    ids = torch.randint(0, problem.num_experts, (problem.num_tokens, problem.topk))
    return x, torch.rand(problem.num_tokens, problem.topk), ids


CASES = [(k, p) for k in KERNELS for p in problems_for(k, MI300X)]


# --- the tests --------------------------------------------------------------------------------
def test_every_kernel_is_registered_and_has_cases():
    for kernel in KERNELS:
        assert default_registry.get(kernel.name) is kernel
        assert kernel.layout is WeightLayout.AITER_SHUFFLED
        assert any(k is kernel for k, _ in CASES), f"{kernel.name} runs no small problem"


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_every_declared_call_exists_in_installed_aiter_with_its_keywords(kernel):
    for module, function, keywords in kernel.aiter_calls():
        params = real_signature(module, function).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        missing = [k for k in keywords if k not in params and not takes_any]
        assert not missing, f"{module}.{function} has no parameter(s) {missing}"


def test_enum_members_we_name_exist_in_aiter():
    quant, act = real_enum("QuantType"), real_enum("ActivationType")
    assert set(QUANT_TYPES.values()) <= set(quant.__members__)
    assert set(ACTIVATION_TYPES.values()) <= set(act.__members__)


@pytest.mark.parametrize("kernel,problem", CASES,
                         ids=[f"{k.name}-{p.describe().replace(' ', '_')}" for k, p in CASES])
def test_prepare_passes_exactly_the_declared_keywords(fake_aiter, kernel, problem):
    calls, _ = fake_aiter
    params = {p.name: p.choices[-1] for p in kernel.params}
    weights = weights_for(problem)
    fn = kernel.prepare(problem, params, weights)
    x, topk_weights, topk_ids = routed_batch(problem)
    out = fn(x, topk_weights, topk_ids)
    assert out.shape == x.shape

    module, function, keywords = kernel.aiter_call
    moe = [c for c in calls if (c.module, c.function) == (module, function)]
    assert len(moe) == 1
    call = moe[0]
    assert set(call.kwargs) == set(keywords)
    # hidden_states, w1, w2, topk_weight, topk_ids: positional, in aiter's order and dtypes.
    hidden, w1, w2, tw, ti = call.args
    assert hidden is x and tw.dtype == torch.float32 and ti.dtype == torch.int32
    assert w1.is_shuffled and w2.is_shuffled
    assert w1.shape == weights.w13.shape and w2.shape == weights.w2.shape
    shuffles = [c for c in calls if c.function == "shuffle_weight"]
    assert len(shuffles) == 2 and all(c.kwargs == {"layout": (16, 16)} for c in shuffles)
    if problem.quant.is_fp8:
        assert w1.dtype == torch.float8_e4m3fnuz  # gfx942's fp8
    enums = [v for v in call.kwargs.values() if isinstance(v, enum.Enum)]
    names = {v.name for v in enums}
    if "activation" in keywords:
        assert ACTIVATION_TYPES[problem.activation] in names
    if "quant_type" in keywords:
        assert QUANT_TYPES[problem.quant] in names
        assert call.kwargs["doweight_stage1"] is problem.router_weight_on_input


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_prepared_calls_write_into_a_given_output(fake_aiter, kernel):
    problem = next(p for k, p in CASES if k is kernel)
    params = {p.name: p.choices[-1] for p in kernel.params}
    fn = kernel.prepare(problem, params, weights_for(problem))
    x, topk_weights, topk_ids = routed_batch(problem)
    out = torch.full_like(x, float("nan"))
    assert fn(x, topk_weights, topk_ids, out=out) is out
    assert torch.equal(out, torch.zeros_like(x))  # what the fake aiter returns


def test_fused_moe_block_size_zero_means_aiters_choice(fake_aiter):
    calls, _ = fake_aiter
    problem = MoEProblem(8, 256, 256, 4, 2)
    fn = AiterFusedMoeKernel.prepare(problem, {"block_size_M": 0}, weights_for(problem))
    fn(*routed_batch(problem))
    assert calls[-1].kwargs["block_size_M"] is None


def test_e4m3fn_weights_become_e4m3fnuz_with_doubled_scales_on_gfx942(fake_aiter):
    calls, set_arch = fake_aiter
    problem = MoEProblem(8, 256, 256, 4, 1, quant="fp8_per_channel", router_weight_on_input=True)
    weights = weights_for(problem)
    AiterAsmTkw1Kernel.prepare(problem, {}, weights)(*routed_batch(problem))
    call = calls[-1]
    w1, scale = call.args[1], call.kwargs["fc1_scale"]
    assert scale.shape == (*weights.w13_scale.shape, 1)
    # The same values: fnuz reads the bits as half, the scale doubles. The fake shuffle copies.
    assert torch.equal(w1.float() * scale, weights.w13.float() * weights.w13_scale[..., None])
    set_arch("gfx950")
    AiterAsmTkw1Kernel.prepare(problem, {}, weights)(*routed_batch(problem))
    assert calls[-1].args[1].dtype == torch.float8_e4m3fn
    assert torch.equal(calls[-1].kwargs["fc1_scale"], weights.w13_scale[..., None])


def test_weights_already_shuffled_are_used_as_they_are(fake_aiter):
    calls, _ = fake_aiter
    problem = MoEProblem(8, 256, 256, 4, 2)
    weights = weights_for(problem)
    for w in (weights.w13, weights.w2):
        w.is_shuffled = True
    AiterFusedMoeKernel.prepare(problem, {"block_size_M": 32}, weights)(*routed_batch(problem))
    assert not [c for c in calls if c.function == "shuffle_weight"]
    assert calls[-1].args[1] is weights.w13


def test_a_keyword_aiter_lacks_fails_the_fake_call(fake_aiter):
    module, function, _ = AiterFusedMoeKernel.aiter_call
    fused_moe = getattr(sys.modules[module], function)
    x = torch.zeros(2, 4)
    with pytest.raises(TypeError, match="swiglu_limit"):
        fused_moe(x, x, x, x, x, swiglu_limit=0.0)  # what newer vLLM passes to aiter 0.1.7


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_ineligible_off_amd_with_a_reason(kernel, cpu_sku):
    problem = problems_for(kernel, MI300X)[0]
    for sku in (cpu_sku, H200):
        ok, why = kernel.supports(problem, sku)
        assert not ok and why.startswith(f"{kernel.name}: needs an AMD gfx942")
        assert sku.label() in why


def test_eligibility_on_gfx942_and_gfx950():
    block = MoEProblem(16, 7168, 256, 256, 8, quant="fp8_block_128x128")
    llama4 = MoEProblem(16, 5120, 1024, 128, 1, quant="fp8_per_channel",
                        router_weight_on_input=True)
    assert AiterFusedMoeKernel.supports(block, MI300X) == (True, None)
    assert AiterAsmBlockscaleKernel.supports(block, MI300X) == (True, None)
    assert AiterAsmTkw1Kernel.supports(llama4, MI300X) == (True, None)
    assert AiterAsmTkw1Kernel.supports(llama4, MI355X) == (True, None)
    ok, why = AiterAsmBlockscaleKernel.supports(block, MI355X)
    assert not ok and "gfx942" in why  # asm_moe asserts e4m3fnuz weights
    ok, why = AiterAsmTkw1Kernel.supports(dataclasses.replace(llama4, topk=2), MI300X)
    assert not ok and "top-1" in why
    ok, why = AiterFusedMoeKernel.supports(dataclasses.replace(block, dtype="float32"), MI300X)
    assert not ok and "float32" in why
    ok, why = AiterFusedMoeKernel.supports(dataclasses.replace(block, gated=False), MI300X)
    assert not ok and "gated" in why
