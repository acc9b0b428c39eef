"""aiter's Triton MoE path on this CPU through Triton's interpreter, in float32 and float16 at tiny
shapes: routing alignment, every aiter kernel against the reference, and CPU eligibility.

``triton.jit`` picks the interpreter when a kernel is *defined*, and aiter's modules are loaded
once per process, so the interpreted checks run in a fresh process that sets TRITON_INTERPRET=1
before anything imports them (the outer test below); run there, they are ordinary tests.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

from moetune.errors import InvalidParamsError
from moetune.runtime.kernels.triton_config import with_prefix
from moetune.runtime.vllm.configs import vllm_default_config
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.registry import default_registry
from moetune.tuner.gate import relative_error
from moetune.tuner.inputs import make_batch, make_weights
from tests.routing_checks import check_routing, random_ids, with_unrouted

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Collected only inside the fresh process the outer test starts (tests/conftest.py), so the
# outer run neither skips nor counts them.
interpreted = pytest.mark.fresh_process("TRITON_INTERPRET")
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")

# The interpreter runs numpy: float32 is exact up to summation order, float16 rounds like the GPU.
# aiter's fused GELU is the tanh approximation (~2e-4 from exact GELU on these inputs).
TOLERANCE = {"float32": 1e-5, "float16": 1e-2}
TANH_GELU_TOLERANCE = 1e-3
CASES = [
    (MoEProblem(3, 64, 32, 8, 2, dtype="float32"), {}),
    (MoEProblem(5, 48, 40, 4, 1, dtype="float16", router_weight_on_input=True), {}),
    (MoEProblem(7, 64, 32, 8, 2, dtype="float32", activation="gelu", gated=False), {}),
    (MoEProblem(9, 72, 32, 16, 4, dtype="float16"), {"BLOCK_SIZE_N": 64}),  # 72 % 64: masked K
]
SMALL = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
         "num_warps": 4, "num_stages": 2}
E2E = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K1": 32, "BLOCK_SIZE_K2": 32,
       "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 2}


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_interpreted_checks_pass_in_a_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         check=False, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_aiter_kernels_need_a_gpu_without_the_interpreter(cpu_sku):
    problem = MoEProblem(4, 64, 32, 8, 2, dtype="float32")
    for name in ("aiter_triton", "aiter_triton_split", "aiter_triton_silu_fused", "aiter_triton_e2e",
                 "aiter_triton_persistent", "aiter_triton_silu_fused_persistent"):
        ok, why = default_registry.get(name).supports(problem, cpu_sku)
        assert not ok and "GPU" in why, why


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
@pytest.mark.parametrize("module,fn", [("moe_op", "fused_moe"), ("silu_fused", "fused_moe_silu"),
                                       ("gelu", "fused_moe_gelu")])
def test_persistent_flag_is_the_one_aiters_wrapper_reads_and_is_restored(module, fn):
    from moetune.runtime import aiter_loader
    from moetune.runtime.kernels.aiter_triton import _persistent_flag

    loaded = aiter_loader.load(module).module
    wrapper = getattr(loaded, fn)
    assert "_USE_MOE_PERSISTENT_KERNEL" in wrapper.__code__.co_names  # read at launch time
    inside = []
    with _persistent_flag(wrapper, True):
        inside.append(loaded._USE_MOE_PERSISTENT_KERNEL)
    assert inside == [True] and loaded._USE_MOE_PERSISTENT_KERNEL is False
    with pytest.raises(TypeError, match="no persistent kernel"):
        _persistent_flag(relative_error, True)


@interpreted
@pytest.mark.parametrize("one_program", [True, False], ids=["one-launch", "three-launches"])
def test_align_groups_every_routed_pair_by_expert_in_padded_blocks(one_program):
    from moetune.runtime.kernels._align import ONE_PROGRAM_MAX, align

    gen = torch.Generator().manual_seed(0)
    for m, topk, e, block in ((1, 1, 8, 16), (3, 2, 8, 16), (37, 8, 256, 64), (200, 2, 8, 128),
                              (300, 8, 128, 16)):
        ids = random_ids(m, topk, e, gen)
        r = align(ids, block, e, one_program_max=ONE_PROGRAM_MAX if one_program else 0)
        check_routing(ids, block, e, r)


@interpreted
@pytest.mark.parametrize("problem,override", CASES, ids=lambda c: c.describe().replace(" ", "-")
                         if isinstance(c, MoEProblem) else "+".join(c) or "small")
@pytest.mark.parametrize("name", ["aiter_triton", "aiter_triton_split", "aiter_triton_silu_fused",
                                  "aiter_triton_gelu_fused", "aiter_triton_e2e"])
def test_aiter_kernel_matches_reference_interpreted(name, problem, override, cpu_sku):
    kernel = default_registry.get(name)
    ok, why = kernel.supports(problem, cpu_sku)
    if not ok:
        assert "only" in why or "router weight" in why, why  # activation/quant limits, not the CPU
        pytest.skip(why)
    config = {**SMALL, **override}
    params = {"aiter_triton": config, "aiter_triton_e2e": E2E}.get(
        name, {**with_prefix(config, "g1_"), **with_prefix(dict(config, BLOCK_SIZE_M=32), "g2_")})
    weights = make_weights(problem, "cpu", seed=1)
    batch = make_batch(problem, "cpu", seed=2)
    ref = default_registry.get("reference").prepare(problem, {}, weights)(*batch.args())
    out = kernel.prepare(problem, kernel.validate(params), weights)(*batch.args())
    assert out.dtype == batch.x.dtype and out.shape == batch.x.shape
    tol = TOLERANCE[problem.dtype.value]
    if name == "aiter_triton_gelu_fused":
        tol = max(tol, TANH_GELU_TOLERANCE)
    assert relative_error(out, ref) <= tol


@interpreted
def test_interpreter_refuses_bfloat16_and_fp8(cpu_sku):
    kernel = default_registry.get("aiter_triton")
    ok, why = kernel.supports(MoEProblem(4, 64, 32, 8, 2), cpu_sku)
    assert not ok and "bfloat16" in why
    ok, why = kernel.supports(MoEProblem(4, 128, 128, 8, 2, quant="fp8_per_tensor",
                                         dtype="float32"), cpu_sku)
    assert not ok and "fp8" in why


@interpreted
def test_vllm_default_config_runs_interpreted(cpu_sku):
    problem = MoEProblem(2, 64, 64, 4, 2, dtype="float32")
    weights = make_weights(problem, "cpu", seed=1)
    batch = make_batch(problem, "cpu", seed=2)
    kernel = default_registry.get("aiter_triton")
    out = kernel.prepare(problem, vllm_default_config(problem), weights)(*batch.args())
    ref = default_registry.get("reference").prepare(problem, {}, weights)(*batch.args())
    assert relative_error(out, ref) <= TOLERANCE["float32"]


# --- moetune_decode: the small-M kernel (two launches, no routing step) ------------------------
# Its interpreted checks run in a process of their own (the outer test below), so the aiter
# checks above keep their time budget.
decode_interpreted = pytest.mark.fresh_process("TRITON_INTERPRET", "MOETUNE_DECODE_CHECKS")
DECODE = {"g1_BLOCK_N": 16, "g1_BLOCK_K": 64, "g1_num_warps": 4, "g1_num_stages": 2,
          "g2_BLOCK_N": 32, "g2_BLOCK_K": 32, "g2_num_warps": 4, "g2_num_stages": 2,
          "SPLIT_K": 1, "REDUCE": "atomic", "PDL": 0}
# (problem, overrides): float32/float16, gated or not, silu/gelu, top-1 (a direct store) and
# top-k (each reduce), the router weight on the input, split-K on and off, and tails: H=72 and
# I=40 are multiples of no tile here; I=100 leaves the last split 4 columns.
DECODE_CASES = [
    (MoEProblem(3, 64, 32, 8, 2, dtype="float32"), {}),
    (MoEProblem(3, 64, 64, 8, 2, dtype="float32"), {"SPLIT_K": 2, "REDUCE": "ordered"}),
    (MoEProblem(2, 72, 40, 8, 1, dtype="float16", router_weight_on_input=True), {}),
    (MoEProblem(2, 72, 40, 8, 1, dtype="float16", router_weight_on_input=True), {"SPLIT_K": 2}),
    (MoEProblem(3, 48, 40, 8, 3, dtype="float16", activation="gelu", gated=False),
     {"REDUCE": "atomic_out"}),
    (MoEProblem(4, 64, 48, 16, 4, dtype="float32", activation="gelu"), {"REDUCE": "ordered"}),
    (MoEProblem(2, 64, 96, 8, 2, dtype="float16", gated=False, router_weight_on_input=True),
     {"SPLIT_K": 2, "REDUCE": "atomic_out"}),
    (MoEProblem(2, 72, 100, 8, 2, dtype="float32"), {"SPLIT_K": 4, "g1_BLOCK_K": 128}),
    (MoEProblem(2, 72, 40, 8, 2, dtype="float16"), {"SPLIT_K": 2, "REDUCE": "ordered"}),
    # GEMM1 tiles of one and two rows of I (40 programs per pair; 20 with the zeroing spread
    # over them).
    (MoEProblem(2, 72, 40, 8, 2, dtype="float16"), {"g1_BLOCK_N": 1}),
    (MoEProblem(2, 72, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     {"g1_BLOCK_N": 2, "SPLIT_K": 2, "REDUCE": "atomic_out"}),
]


def _case_id(case):
    return case.describe().replace(" ", "-") if isinstance(case, MoEProblem) else (
        "+".join(f"{k}={v}" for k, v in case.items()) or "base")


def _checks_pass_in_a_fresh_process(flag: str, selection: str, expected: int) -> None:
    """Run this file's checks matching ``selection`` interpreted, in a process that sets
    ``flag``; all ``expected`` of them must pass (none skipped by a mistyped selection)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", flag: "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                          selection, __file__], check=False, env=env, capture_output=True,
                         text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"{expected} passed" in run.stdout.strip().splitlines()[-1], run.stdout[-2000:]


def _prepared(name: str, params: dict, problem: MoEProblem, cpu_sku) -> tuple:
    """``name`` prepared at ``params`` (eligible here, valid, fitting), a batch, and the float32
    reference's output on it."""
    kernel = default_registry.get(name)
    assert kernel.supports(problem, cpu_sku) == (True, None)
    params = kernel.validate(params)
    assert kernel.check_params(problem, params) is None
    weights = make_weights(problem, "cpu", seed=1)
    batch = make_batch(problem, "cpu", seed=2)
    ref = default_registry.get("reference").prepare(problem, {}, weights)(*batch.args())
    return kernel.prepare(problem, params, weights), batch, ref


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_decode_checks_pass_in_a_fresh_process():
    _checks_pass_in_a_fresh_process("MOETUNE_DECODE_CHECKS", "decode",
                                    len(DECODE_CASES) + len(FP8_EMULATED) + 1)


@decode_interpreted
@pytest.mark.parametrize("problem,override", DECODE_CASES, ids=_case_id)
def test_decode_kernel_matches_reference_interpreted(problem, override, cpu_sku):
    fn, batch, ref = _prepared("moetune_decode", {**DECODE, **override}, problem, cpu_sku)
    out = fn(*batch.args())
    assert out.dtype == batch.x.dtype and out.shape == batch.x.shape
    assert relative_error(out, ref) <= TOLERANCE[problem.dtype.value]


# fp8 weights cannot run here, but their scales can: float32 weights holding the fp8 values,
# with the scheme's scales, go through the kernel's dequantization exactly as on the GPU (the
# reference multiplies the same values by the same scales). The tuner's weights give each
# group its own scale, so a scale read from the wrong row, block or expert fails.
FP8_EMULATED = [
    (MoEProblem(3, 64, 48, 8, 2, dtype="float32", quant="fp8_per_tensor"), {}),
    (MoEProblem(2, 64, 48, 8, 1, dtype="float32", quant="fp8_per_channel",
                router_weight_on_input=True), {"SPLIT_K": 2}),
    (MoEProblem(3, 64, 48, 8, 2, dtype="float32", quant="fp8_per_channel", gated=False,
                activation="gelu"), {"REDUCE": "ordered"}),
    # BLOCK_K 256 spans both 128-column scale blocks of H, 64 lies inside one; the gate and up
    # halves of W13 sit in different 128-row blocks.
    (MoEProblem(2, 256, 128, 4, 2, dtype="float32", quant="fp8_block_128x128"),
     {"g1_BLOCK_N": 32, "g1_BLOCK_K": 256, "g1_num_warps": 8, "g2_BLOCK_N": 64,
      "g2_BLOCK_K": 64, "g2_num_warps": 8}),
    (MoEProblem(2, 256, 256, 4, 2, dtype="float32", quant="fp8_block_128x128"),
     {"g1_BLOCK_N": 64, "g1_BLOCK_K": 64, "g1_num_warps": 8, "g2_BLOCK_N": 128,
      "g2_BLOCK_K": 128, "g2_num_warps": 8, "SPLIT_K": 2, "REDUCE": "ordered"}),
]


def _check_fp8_scales(name: str, params: dict, problem: MoEProblem, cpu_sku) -> None:
    """``name``, refused real fp8 weights here, matches the reference on float32 weights holding
    fp8 values with the scheme's scales, and misses it by far with GEMM2's scales left out."""
    kernel = default_registry.get(name)
    ok, why = kernel.supports(problem, cpu_sku)
    assert not ok and "fp8" in why  # real fp8 weights are refused here
    params = kernel.validate(params)
    assert kernel.check_params(problem, params) is None
    weights = make_weights(problem, "cpu", seed=1)
    weights.w13, weights.w2 = weights.w13.float(), weights.w2.float()
    batch = make_batch(problem, "cpu", seed=2)
    ref = default_registry.get("reference").prepare(problem, {}, weights)(*batch.args())
    out = kernel.prepare(problem, params, weights)(*batch.args())
    assert relative_error(out, ref) <= TOLERANCE["float32"]
    unscaled = dataclasses.replace(weights, w2_scale=torch.ones_like(weights.w2_scale))
    wrong = kernel.prepare(problem, params, unscaled)(*batch.args())
    assert relative_error(wrong, ref) > 10 * TOLERANCE["float16"]


@decode_interpreted
@pytest.mark.parametrize("problem,override", FP8_EMULATED, ids=_case_id)
def test_decode_kernel_applies_fp8_scales_interpreted(problem, override, cpu_sku):
    _check_fp8_scales("moetune_decode", {**DECODE, **override}, problem, cpu_sku)


@decode_interpreted
def test_tuner_offers_and_gates_the_decode_kernel_interpreted(cpu_sku):
    from moetune.runtime.registry import Registry
    from moetune.tuner.measure import Measurer, Status

    problem = MoEProblem(1, 64, 32, 4, 2, dtype="float32")
    registry = Registry({n: p for n, p in default_registry.paths().items()
                         if n in ("reference", "torch_loop", "moetune_decode")})
    assert "moetune_decode" in [k.name for k in registry.candidates(problem, cpu_sku)]
    kernel = registry.get("moetune_decode")
    seed = kernel.seed_params(problem, cpu_sku)
    assert seed is not None and kernel.validate(seed) == seed
    measurer = Measurer(problem, "cpu", registry, reps=2)
    result = measurer.measure("moetune_decode", dict(DECODE, g1_BLOCK_N=32, g2_BLOCK_N=64))
    assert result.status is Status.OK and result.error <= 1e-5, result
    assert not registry.get("moetune_decode").supports(problem.with_tokens(129), cpu_sku)[0]


H100 = SKU(Vendor.NVIDIA, "H100", "sm_90", 132, 80 << 30)
DECODE_SKUS = {"sm_90": H100, "sm_80": SKU(Vendor.NVIDIA, "A100", "sm_80", 108, 80 << 30),
               "sm_75": SKU(Vendor.NVIDIA, "T4", "sm_75", 40, 16 << 30),
               "gfx942": SKU(Vendor.AMD, "MI300X", "gfx942", 304, 192 << 30),
               "gfx950": SKU(Vendor.AMD, "MI355X", "gfx950", 256, 288 << 30),
               "gfx90a": SKU(Vendor.AMD, "MI250X", "gfx90a", 110, 64 << 30)}
# The shapes the kernel is for (TP8 where sharded): Llama-4-Maverick, DeepSeek-V3, Qwen3-30B-A3B.
DECODE_SHAPES = {
    "llama4": MoEProblem(1, 5120, 1024, 128, 1, quant="fp8_per_channel",
                         router_weight_on_input=True),
    "deepseek": MoEProblem(1, 7168, 256, 256, 8, quant="fp8_block_128x128"),
    "qwen3": MoEProblem(1, 2048, 768, 128, 8),
}


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_decode_eligibility_names_devices_schemes_and_sizes(cpu_sku):
    kernel = default_registry.get("moetune_decode")
    bf16, block = DECODE_SHAPES["qwen3"], DECODE_SHAPES["deepseek"]
    ok, why = kernel.supports(dataclasses.replace(bf16, dtype="float32"), cpu_sku)
    assert not ok and "GPU" in why  # without TRITON_INTERPRET=1
    verdicts = {arch: (kernel.supports(bf16, sku), kernel.supports(block, sku))
                for arch, sku in DECODE_SKUS.items()}
    assert verdicts["sm_90"] == ((True, None), (True, None))
    assert verdicts["sm_80"][0] == (True, None) and "sm_89" in verdicts["sm_80"][1][1]
    assert "sm_80 or newer" in verdicts["sm_75"][0][1]
    assert verdicts["gfx942"][0] == (True, None) and "e4m3fnuz" in verdicts["gfx942"][1][1]
    assert verdicts["gfx950"] == ((True, None), (True, None))
    assert "gfx942/gfx950" in verdicts["gfx90a"][0][1]
    assert kernel.supports(bf16.with_tokens(32), H100) == (True, None)  # 32 x 8 = 256 pairs
    ok, why = kernel.supports(bf16.with_tokens(33), H100)
    assert not ok and "264 > 256" in why


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=str)
def test_decode_seeds_fit_every_scheme_and_decode_size(shape):
    kernel = default_registry.get("moetune_decode")
    for quant, m in itertools.product(QuantScheme, (1, 2, 4, 8, 16, 32)):
        problem = dataclasses.replace(DECODE_SHAPES[shape], quant=quant, num_tokens=m)
        seed = kernel.seed_params(problem, H100)
        assert seed is not None and kernel.validate(seed) == seed, (problem.describe(), seed)
        assert kernel.check_params(problem, seed) is None


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_decode_constraints_drop_what_cannot_fit_or_repeats_another_point():
    kernel = default_registry.get("moetune_decode")
    llama4, qwen3 = DECODE_SHAPES["llama4"], DECODE_SHAPES["qwen3"]
    ok = kernel.seed_params(qwen3, H100)
    assert kernel.check_params(qwen3, ok) is None
    cases = [
        (qwen3, {"g1_BLOCK_N": 64, "g1_BLOCK_K": 512, "g1_num_warps": 4}, "accumulators"),
        (qwen3, {"g2_BLOCK_N": 8, "g2_BLOCK_K": 256, "SPLIT_K": 4}, "empty"),  # 768: 3 blocks
        (llama4, {"SPLIT_K": 1, "REDUCE": "ordered"}, "directly"),  # top-1: nothing to reduce
        (dataclasses.replace(qwen3, dtype="float32"), {"REDUCE": "atomic_out"}, "float32"),
        (MoEProblem(1, 64, 32, 8, 2), {"g1_BLOCK_N": 64}, "exceeds"),
    ]
    for problem, change, word in cases:
        params = {**kernel.seed_params(problem, H100), **change}
        why = kernel.check_params(problem, params)
        assert why and word in why, (change, why)
    assert kernel.check_params(llama4, {**kernel.seed_params(llama4, H100), "SPLIT_K": 2,
                                        "REDUCE": "ordered"}) is None


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_decode_overlapped_launch_is_offered_on_hopper_cuda_only(monkeypatch):
    from moetune.runtime.kernels import moetune_decode, triton_config

    kernel = default_registry.get("moetune_decode")
    qwen3 = DECODE_SHAPES["qwen3"]
    params = {**kernel.seed_params(qwen3, H100), "PDL": 1}
    verdicts = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for hip, capability in ((None, (9, 0)), (None, (8, 0)), ("6.4", (9, 4))):
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: capability)
        monkeypatch.setattr(moetune_decode, "pdl_reason", triton_config.pdl_reason.__wrapped__)
        verdicts[capability] = kernel.check_params(qwen3, params)
    assert verdicts[(9, 0)] is None
    assert "sm_90" in verdicts[(8, 0)] and "sm_80" in verdicts[(8, 0)]
    assert verdicts[(9, 4)].startswith("PDL=1") and "NVIDIA" in verdicts[(9, 4)]
    # W2 rows of 196 bf16 elements are 392 B: the L2 prefetch moves 16-byte units.
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    odd = dataclasses.replace(qwen3, intermediate_size=196)
    assert "aligned" in kernel.check_params(odd, {**kernel.seed_params(odd, H100), "PDL": 1})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "NVIDIA" in kernel.check_params(qwen3, params)  # the interpreter runs no PTX


# --- moetune_decode_one: the one-launch decode kernel (persistent, counters between phases) ------
# The interpreter runs programs one after another; the launcher then makes the grid a divisor of
# the pairs so that each program owns whole pairs (it never waits on a later one). These checks
# cover the math, the work split over several programs, the ordered reduce and the counters'
# reset between calls; what they cannot cover is concurrency (memory ordering, residency): the
# CUDA tests do.
one_interpreted = pytest.mark.fresh_process("TRITON_INTERPRET", "MOETUNE_DECODE_ONE_CHECKS")
ONE = {"BLOCK_N1": 16, "BLOCK_K1": 64, "BLOCK_N2": 32, "BLOCK_K2": 32, "num_warps": 4,
       "num_stages": 2, "PROGRAMS_PER_SM": 1}
# float32/float16, gated or not, silu/gelu, top-1 (a direct store) and top-k (the ordered
# reduce), the router weight on the input, 1 to 4 programs (4 x 2 pairs split over 4, 3 x 2 over
# 2), and tails: H=72 and I=40 are multiples of no tile here.
ONE_CASES = [
    (MoEProblem(3, 64, 32, 8, 2, dtype="float32"), {}),
    (MoEProblem(4, 64, 32, 8, 2, dtype="float32"), {"PROGRAMS_PER_SM": 4}),
    (MoEProblem(3, 72, 40, 8, 2, dtype="float16"), {"PROGRAMS_PER_SM": 2}),
    (MoEProblem(2, 72, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     {"PROGRAMS_PER_SM": 2, "BLOCK_N1": 1}),
    (MoEProblem(3, 48, 40, 8, 3, dtype="float16", activation="gelu", gated=False),
     {"PROGRAMS_PER_SM": 3, "BLOCK_N2": 8}),
    (MoEProblem(2, 64, 48, 16, 4, dtype="float32", activation="gelu"), {"PROGRAMS_PER_SM": 4}),
    (MoEProblem(8, 64, 32, 16, 8, dtype="float16"), {"PROGRAMS_PER_SM": 4, "BLOCK_N2": 16}),
]


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_one_launch_checks_pass_in_a_fresh_process():
    _checks_pass_in_a_fresh_process("MOETUNE_DECODE_ONE_CHECKS", "one_launch",
                                    len(ONE_CASES) + len(ONE_FP8_EMULATED) + 1)


@one_interpreted
@pytest.mark.parametrize("problem,override", ONE_CASES, ids=_case_id)
def test_one_launch_kernel_matches_reference_on_repeated_calls_interpreted(problem, override,
                                                                          cpu_sku):
    """Three calls on new routing each match the reference: the counters are back at zero
    after every call (a stale count would let a later call read an unfinished row)."""
    from moetune.runtime.kernels import _one_launch

    kernel = default_registry.get("moetune_decode_one")
    assert kernel.supports(problem, cpu_sku) == (True, None)
    params = kernel.validate({**ONE, **override})
    assert kernel.check_params(problem, params) is None
    weights = make_weights(problem, "cpu", seed=1)
    reference = default_registry.get("reference").prepare(problem, {}, weights)
    fn = kernel.prepare(problem, params, weights)
    counters = [c for c in fn.__closure__ if isinstance(c.cell_contents, torch.Tensor)
                and c.cell_contents.dtype == torch.int32]
    assert len(counters) == 3  # done, ready, arrived
    for seed in (2, 3, 4):
        batch = make_batch(problem, "cpu", seed=seed)
        out = torch.full_like(batch.x, float("nan"))
        assert fn(*batch.args(), out=out) is out
        assert relative_error(out, reference(*batch.args())) <= TOLERANCE[problem.dtype.value]
        assert not any(c.cell_contents.any() for c in counters)
    pairs = problem.num_tokens * problem.topk
    assert _one_launch.grid_size(params["PROGRAMS_PER_SM"], pairs, 1 << 20, True) == \
        math.gcd(params["PROGRAMS_PER_SM"], pairs)


ONE_FP8_EMULATED = [
    (MoEProblem(3, 64, 48, 8, 2, dtype="float32", quant="fp8_per_tensor"), {}),
    (MoEProblem(2, 64, 48, 8, 1, dtype="float32", quant="fp8_per_channel",
                router_weight_on_input=True), {"PROGRAMS_PER_SM": 2}),
    # BLOCK_K1 256 spans both 128-column scale blocks of H; gate and up in different row blocks.
    (MoEProblem(2, 256, 128, 4, 2, dtype="float32", quant="fp8_block_128x128"),
     {"BLOCK_N1": 32, "BLOCK_K1": 256, "BLOCK_N2": 64, "BLOCK_K2": 128, "num_warps": 8,
      "PROGRAMS_PER_SM": 4}),
]


@one_interpreted
@pytest.mark.parametrize("problem,override", ONE_FP8_EMULATED, ids=_case_id)
def test_one_launch_kernel_applies_fp8_scales_interpreted(problem, override, cpu_sku):
    """float32 weights holding fp8 values, with the scheme's scales (see the decode test)."""
    _check_fp8_scales("moetune_decode_one", {**ONE, **override}, problem, cpu_sku)


@one_interpreted
def test_tuner_offers_and_gates_the_one_launch_kernel_interpreted(cpu_sku):
    from moetune.runtime.registry import Registry
    from moetune.tuner.measure import Measurer, Status

    problem = MoEProblem(2, 64, 32, 4, 2, dtype="float32")
    registry = Registry({n: p for n, p in default_registry.paths().items()
                         if n in ("reference", "torch_loop", "moetune_decode_one")})
    assert "moetune_decode_one" in [k.name for k in registry.candidates(problem, cpu_sku)]
    kernel = registry.get("moetune_decode_one")
    seed = kernel.seed_params(problem, cpu_sku)
    assert seed is not None and kernel.validate(seed) == seed
    result = Measurer(problem, "cpu", registry, reps=2).measure("moetune_decode_one", seed)
    assert result.status is Status.OK and result.error <= 1e-5, result


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_one_launch_eligibility_seeds_and_constraints():
    kernel = default_registry.get("moetune_decode_one")
    qwen3 = DECODE_SHAPES["qwen3"]
    assert kernel.supports(qwen3.with_tokens(8), H100) == (True, None)  # 8 x 8 = 64 pairs
    ok, why = kernel.supports(qwen3.with_tokens(9), H100)
    assert not ok and "72 > 64" in why
    for shape, quant, m in itertools.product(DECODE_SHAPES, QuantScheme, (1, 2, 4, 8)):
        problem = dataclasses.replace(DECODE_SHAPES[shape], quant=quant, num_tokens=m)
        seed = kernel.seed_params(problem, H100)
        assert seed is not None and kernel.validate(seed) == seed, (problem.describe(), seed)
        assert kernel.check_params(problem, seed) is None
    seed = kernel.seed_params(qwen3, H100)
    tiny = MoEProblem(1, 64, 32, 8, 2)
    cases = [(qwen3, {"BLOCK_N1": 32, "BLOCK_K1": 512}, "accumulators"),
             (qwen3, {"BLOCK_N2": 128, "BLOCK_K2": 512}, "accumulators"),
             (tiny, {"BLOCK_N2": 128, "BLOCK_K2": 32}, "exceeds")]
    for problem, change, word in cases:
        why = kernel.check_params(problem, {**kernel.seed_params(problem, H100), **change})
        assert why and word in why, (change, why)
    block = DECODE_SHAPES["deepseek"]
    assert "scale blocks" not in (kernel.check_params(block, kernel.seed_params(block, H100))
                                  or "")


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_one_launch_grid_stays_resident_and_never_exceeds_the_work():
    from moetune.runtime.kernels._one_launch import grid_size

    assert grid_size(264, 8, 1536, False) == 264  # resident cap
    assert grid_size(264, 1, 40, False) == 40  # no program without an item
    assert grid_size(264, 8, 1536, True) == 8  # interpreter: programs own whole pairs
    assert grid_size(4, 6, 100, True) == 2


# --- moetune_grouped: the prefill kernel (grouped GEMMs, the top-k reduce fused) ----------------
grouped_interpreted = pytest.mark.fresh_process("TRITON_INTERPRET", "MOETUNE_GROUPED_CHECKS")
_TILE = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1,
         "num_warps": 4, "num_stages": 2}
GROUPED = {**with_prefix(_TILE, "g1_"), **with_prefix(_TILE, "g2_"), "REDUCE": "atomic"}
# Every reduce, top-1 (a direct store), the router weight on the input, ungated GELU, a GEMM2
# tile of other rows (routing aligned twice), a GROUP_SIZE_M that reorders tiles, and tails:
# H=72 and I=40 are multiples of no tile; 7 tokens x 3 slots leave padded rows in every block.
# GEMM2 programs of several H tiles: H=72 in 3 tiles, 2 per program (the last half empty),
# I=32 in one K step (every step ends a tile), and top-1's store. Weight tiles through TMA
# descriptors: tiles past H and I (zeros from the descriptor, or the next rows of the weight,
# whose columns are never stored), with each reduce, several H tiles, top-1 and ungated. Gate
# and up tiles in one box (``g1_PAIR_TMA``): I=40 leaves the last tile of each half part empty
# (zeros from the descriptor), with the router weight on the input and per-row tiles reordered.
# GEMM2 programs in column-major order (``g2_N_MAJOR``): several row blocks per column group
# (9 x 3 pairs in blocks of 16), with a GEMM2 tile of other rows, two tiles per program (the
# last half empty), through TMA, and top-1. GEMM2 on a persistent grid (``g2_PERSISTENT``: two
# programs here, each walking several tiles): every reduce, column-major order, a GEMM2 tile of
# other rows, TMA, top-1 on input, I=32 in one K step (every step ends a tile), and units of two
# column tiles (H=72: the second tile of the last unit lies past H). GEMM2's activation tiles
# through TMA (``g2_A_TMA``: the intermediate in sorted order, padded rows never written): each
# reduce, top-1 on input, I=40 past the last K step (zeros from the descriptor), several K steps
# per tile in a loop of two tiles, and the persistent grid.
GROUPED_CASES = [
    (MoEProblem(5, 64, 32, 8, 2, dtype="float32"), {}),
    (MoEProblem(5, 64, 32, 8, 2, dtype="float32"), {"REDUCE": "sum"}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"), {"REDUCE": "atomic_out"}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"), {"g2_BLOCK_SIZE_M": 32, "REDUCE": "sum"}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"), {"g1_GROUP_SIZE_M": 16, "g2_BLOCK_SIZE_N": 64}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True), {}),
    (MoEProblem(6, 64, 48, 8, 2, dtype="float32", activation="gelu", gated=False),
     {"REDUCE": "sum"}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"), {"g2_N_TILES": 2, "REDUCE": "atomic_out"}),
    (MoEProblem(5, 64, 32, 8, 2, dtype="float32"), {"g2_N_TILES": 2, "REDUCE": "sum"}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     {"g2_N_TILES": 2}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"), {"W_TMA": 1, "REDUCE": "atomic_out"}),
    (MoEProblem(5, 64, 32, 8, 2, dtype="float32"), {"W_TMA": 1, "g2_N_TILES": 2, "REDUCE": "sum"}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True), {"W_TMA": 1}),
    (MoEProblem(6, 64, 48, 8, 2, dtype="float32", activation="gelu", gated=False), {"W_TMA": 1}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"),
     {"W_TMA": 1, "g1_PAIR_TMA": 1, "REDUCE": "atomic_out"}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     {"W_TMA": 1, "g1_PAIR_TMA": 1, "g1_GROUP_SIZE_M": 16}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"), {"g2_N_MAJOR": 1, "REDUCE": "atomic_out"}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"),
     {"g2_N_MAJOR": 1, "g2_BLOCK_SIZE_M": 32, "g2_N_TILES": 2, "W_TMA": 1, "REDUCE": "sum"}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     {"g2_N_MAJOR": 1}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"), {"g2_PERSISTENT": 2, "REDUCE": "atomic_out"}),
    (MoEProblem(5, 64, 32, 8, 2, dtype="float32"), {"g2_PERSISTENT": 2, "REDUCE": "sum"}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"),
     {"g2_PERSISTENT": 2, "g2_N_TILES": 2, "REDUCE": "atomic_out"}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"),
     {"g2_PERSISTENT": 2, "g2_N_TILES": 2, "g2_N_MAJOR": 1, "W_TMA": 1}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"),
     {"g2_PERSISTENT": 4, "g2_N_MAJOR": 1, "g2_BLOCK_SIZE_M": 32, "W_TMA": 1}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     {"g2_PERSISTENT": 4, "g1_GROUP_SIZE_M": 16, "g2_GROUP_SIZE_M": 16}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"), {"g2_A_TMA": 1, "REDUCE": "atomic_out"}),
    (MoEProblem(5, 64, 32, 8, 2, dtype="float32"), {"g2_A_TMA": 1, "REDUCE": "sum"}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     {"g2_A_TMA": 1, "W_TMA": 1}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"),
     {"g2_A_TMA": 1, "g2_N_TILES": 2, "g2_N_MAJOR": 1}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"),
     {"g2_A_TMA": 1, "g2_PERSISTENT": 2, "g2_N_TILES": 2, "W_TMA": 1}),
]


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_grouped_checks_pass_in_a_fresh_process():
    _checks_pass_in_a_fresh_process("MOETUNE_GROUPED_CHECKS", "grouped",
                                    len(GROUPED_CASES) + 2 + len(FP8_OUT_CASES))


@grouped_interpreted
@pytest.mark.parametrize("problem,override", GROUPED_CASES, ids=_case_id)
def test_grouped_kernel_matches_reference_interpreted(problem, override, cpu_sku):
    fn, batch, ref = _prepared("moetune_grouped", {**GROUPED, **override}, problem, cpu_sku)
    out = torch.full_like(batch.x, float("nan"))
    assert fn(*batch.args(), out=out) is out
    assert relative_error(out, ref) <= TOLERANCE[problem.dtype.value]


# GEMM1's epilogue writing GEMM2's block-fp8 input (``g1_FP8_OUT``): tiles of one and of two
# 128-column groups (I = 384: the last 256-column tile half past I), with the sorted intermediate
# and paired gate and up tiles, and with vLLM's separate sum over two GEMM2 tiles per program.
FP8_OUT_CASES = [
    {"g1_BLOCK_SIZE_N": 128},
    {"g1_BLOCK_SIZE_N": 256},
    {"g1_BLOCK_SIZE_N": 128, "g2_A_TMA": 1, "W_TMA": 1, "g1_PAIR_TMA": 1},
    {"g1_BLOCK_SIZE_N": 256, "REDUCE": "sum", "g2_N_TILES": 2},
]


@grouped_interpreted
@pytest.mark.parametrize("override", FP8_OUT_CASES, ids=str)
def test_grouped_fp8_epilogue_writes_what_the_separate_quantization_would(override):
    """The interpreter's fp8 rounding is not the GPU's (so fp8 layers are not offered under it,
    and the CUDA tests hold these against the reference): here the fused epilogue is held
    against the separate quantization launch at the same tiles, and both against the
    reference's error level, which a scale written to the wrong row or group exceeds by ten."""
    problem = MoEProblem(7, 256, 384, 8, 3, dtype="float16", quant="fp8_block_128x128")
    kernel = default_registry.get("moetune_grouped")
    params = {**GROUPED, "g2_BLOCK_SIZE_N": 128, "g1_BLOCK_SIZE_K": 64,
              "g2_BLOCK_SIZE_K": 64, **override}
    weights = make_weights(problem, "cpu", seed=1)
    batch = make_batch(problem, "cpu", seed=2)
    ref = default_registry.get("reference").prepare(problem, {}, weights)(*batch.args())
    outs = []
    for fused in (0, 1):
        point = kernel.validate({**params, "g1_FP8_OUT": fused})
        assert kernel.check_params(problem, point) is None
        outs.append(kernel.prepare(problem, point, weights)(*batch.args()))
    separate, fused = outs
    assert relative_error(fused, separate) < 0.03  # fp16 rounding before the separate launch
    assert relative_error(fused, ref) < 1.1 * relative_error(separate, ref) < 0.1


@grouped_interpreted
@pytest.mark.parametrize("reduce", ["atomic_out", "atomic"])
def test_grouped_output_may_be_a_view_of_wider_rows(reduce, cpu_sku):
    """GEMM1 zeroes what GEMM2 adds into row by row at the output's stride: the columns past
    the view keep what they held."""
    problem = MoEProblem(7, 72, 40, 4, 3, dtype="float16")
    fn, batch, ref = _prepared("moetune_grouped", {**GROUPED, "REDUCE": reduce}, problem, cpu_sku)
    wide = torch.full((7, 80), float("nan"), dtype=batch.x.dtype)
    out = wide[:, :72]
    assert fn(*batch.args(), out=out) is out
    assert relative_error(out, ref) <= TOLERANCE["float16"]
    assert wide[:, 72:].isnan().all()


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_grouped_eligibility_names_devices_and_schemes(cpu_sku):
    kernel = default_registry.get("moetune_grouped")
    bf16 = MoEProblem(2048, 2048, 768, 128, 8)
    block = MoEProblem(2048, 7168, 256, 256, 8, quant="fp8_block_128x128")
    ok, why = kernel.supports(dataclasses.replace(bf16, dtype="float32"), cpu_sku)
    assert not ok and "GPU" in why  # without TRITON_INTERPRET=1
    verdicts = {arch: (kernel.supports(bf16, sku), kernel.supports(block, sku))
                for arch, sku in DECODE_SKUS.items()}
    assert verdicts["sm_90"] == ((True, None), (True, None))
    assert verdicts["sm_80"][0] == (True, None) and "sm_89" in verdicts["sm_80"][1][1]
    assert "sm_80 or newer" in verdicts["sm_75"][0][1]
    assert verdicts["gfx942"][0] == (True, None) and "e4m3fnuz" in verdicts["gfx942"][1][1]
    assert verdicts["gfx950"] == ((True, None), (True, None))
    assert "gfx942/gfx950" in verdicts["gfx90a"][0][1]


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_grouped_seeds_fit_every_preset_bucket():
    from moetune.tuner.presets import PRESETS

    kernel = default_registry.get("moetune_grouped")
    for name, spec in PRESETS.items():
        for m in spec.buckets:
            problem = spec.shape.problem(m)
            seed = kernel.seed_params(problem, H100)
            assert seed is not None and kernel.validate(seed) == seed, (name, m, seed)
            assert seed["g1_BLOCK_SIZE_M"] >= 16 and seed["g2_BLOCK_SIZE_M"] >= 16


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_grouped_rows_stored_before_n_tiles_existed_run_one_tile_per_program():
    kernel = default_registry.get("moetune_grouped")
    older = {k: v for k, v in kernel.seed_params(MoEProblem(2048, 2048, 768, 128, 8), H100).items()
             if k != "g2_N_TILES"}
    assert kernel.validate(older) == {**older, "g2_N_TILES": 1}
    with pytest.raises(InvalidParamsError, match="g2_N_TILES=3"):
        kernel.validate({**older, "g2_N_TILES": 3})


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_grouped_constraints_drop_what_cannot_fit_or_repeats_another_point():
    kernel = default_registry.get("moetune_grouped")
    qwen3 = MoEProblem(2048, 2048, 768, 128, 8)
    llama4 = MoEProblem(2048, 5120, 1024, 128, 1, quant="fp8_per_channel",
                        router_weight_on_input=True)
    block = MoEProblem(2048, 7168, 256, 256, 8, quant="fp8_block_128x128")
    # Gate and up tiles both stay in shared memory: 2 x (64x128 + 2 x 128x256) x 2 B > 227 KiB,
    # where GEMM2's single weight tile (2 x (64x128 + 128x256) x 2 B) fits.
    big = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 128, "num_stages": 2}
    cases = [
        (qwen3, with_prefix(big, "g1_"), "g1: needs"),
        (qwen3, {"g2_BLOCK_SIZE_M": 8}, "16 rows"),
        (block, {"g1_BLOCK_SIZE_K": 256, "g1_num_stages": 2}, "spans two"),
        (llama4, {"REDUCE": "sum"}, "directly"),  # top-1: nothing to reduce
        (dataclasses.replace(qwen3, dtype="float32"), {**with_prefix(_TILE, "g1_"),
                                                       "REDUCE": "atomic_out"}, "float32"),
        (qwen3, {"g2_BLOCK_SIZE_N": 256, "g2_N_TILES": 8}, None),  # 2048 = 8 x 256: all full
        (dataclasses.replace(qwen3, hidden_size=1536), {"g2_BLOCK_SIZE_N": 256, "g2_N_TILES": 8},
         "empty"),
        (qwen3, {"W_TMA": 1}, None),
        # fp8 rows of 2040 elements are 2040 B, not a multiple of 16; in bf16 they are 4080 B.
        (dataclasses.replace(qwen3, hidden_size=2040, quant="fp8_per_channel"), {"W_TMA": 1},
         "aligned"),
        (dataclasses.replace(qwen3, hidden_size=2040), {"W_TMA": 1}, None),
        (qwen3, {"W_TMA": 1, "g1_PAIR_TMA": 1}, None),
        (llama4, {"W_TMA": 1, "g1_PAIR_TMA": 1}, None),
        (qwen3, {"W_TMA": 0, "g1_PAIR_TMA": 1}, "needs W_TMA=1"),
        (dataclasses.replace(qwen3, gated=False, activation="gelu"),
         {"W_TMA": 1, "g1_PAIR_TMA": 1}, "not gated"),
        (block, {"W_TMA": 1, "g1_PAIR_TMA": 1, "g1_BLOCK_SIZE_N": 64}, None),
        (block, {"W_TMA": 1, "g1_PAIR_TMA": 1, "g1_BLOCK_SIZE_N": 128}, None),
        (block, {"W_TMA": 1, "g1_PAIR_TMA": 1, "g1_BLOCK_SIZE_N": 256}, "128-row scale block"),
        (block, {"g2_PERSISTENT": 2, "g2_N_MAJOR": 1}, None),
        (qwen3, {"g2_PERSISTENT": 2, "g2_BLOCK_SIZE_N": 256, "g2_N_TILES": 8}, None),
        (dataclasses.replace(qwen3, hidden_size=1536),
         {"g2_PERSISTENT": 2, "g2_BLOCK_SIZE_N": 256, "g2_N_TILES": 8}, "empty"),
        (block, {"g2_A_TMA": 1}, None),
        (qwen3, {"g2_A_TMA": 1, "g2_BLOCK_SIZE_M": 128, "g1_BLOCK_SIZE_M": 64}, "as they lie"),
        # fp8 rows of I = 200 elements are 200 B, not a multiple of 16; in bf16 400 B.
        (dataclasses.replace(block, intermediate_size=200, quant="fp8_per_channel"),
         {"g2_A_TMA": 1}, "aligned"),
        (dataclasses.replace(qwen3, intermediate_size=200), {"g2_A_TMA": 1}, None),
        (block, {"g1_FP8_OUT": 1, "g1_BLOCK_SIZE_N": 128}, None),
        (block, {"g1_FP8_OUT": 1, "g1_BLOCK_SIZE_N": 256, "g1_PAIR_TMA": 0}, None),
        (block, {"g1_FP8_OUT": 1, "g1_BLOCK_SIZE_N": 64}, "no whole 128-column group"),
        (qwen3, {"g1_FP8_OUT": 1, "g1_BLOCK_SIZE_N": 128}, "only block-fp8"),
        (llama4, {"g1_FP8_OUT": 1, "g1_BLOCK_SIZE_N": 128}, "only block-fp8"),
    ]
    for problem, change, word in cases:
        params = {**kernel.seed_params(dataclasses.replace(problem, dtype="bfloat16"), H100),
                  **change}
        why = kernel.check_params(problem, params)
        assert (why is None) if word is None else (why and word in why), (change, why)
    assert kernel.check_params(qwen3, {**kernel.seed_params(qwen3, H100),
                                       **with_prefix(big, "g2_")}) is None


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_tma_variant_is_refused_where_the_device_has_no_tma_unit(monkeypatch):
    from moetune.runtime.kernels.triton_config import tma_reason

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    verdicts = {}
    for hip, capability in ((None, (9, 0)), (None, (8, 0)), ("6.4", (9, 4))):
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: capability)
        verdicts[capability] = tma_reason.__wrapped__()
    assert verdicts[(9, 0)] is None
    assert "sm_90" in verdicts[(8, 0)] and "sm_80" in verdicts[(8, 0)]
    assert "ROCm" in verdicts[(9, 4)]
    # moetune_grouped's descriptor loads (weights, GEMM2's activations) say so at that point.
    from moetune.runtime.kernels import moetune_grouped

    monkeypatch.undo()  # a CPU again, but for the reason
    monkeypatch.setattr(moetune_grouped, "tma_reason", lambda: verdicts[(9, 4)])
    kernel = default_registry.get("moetune_grouped")
    problem = MoEProblem(2048, 2048, 768, 128, 8)
    seed = {**kernel.seed_params(problem, H100), "W_TMA": 0, "g1_PAIR_TMA": 0}
    assert kernel.check_params(problem, seed) is None
    for name in ("W_TMA", "g2_A_TMA"):
        why = kernel.check_params(problem, {**seed, name: 1})
        assert why == f"{name}=1: {verdicts[(9, 4)]}"


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_grouped_takes_over_a_vllm_config_at_the_same_work_per_program():
    kernel = default_registry.get("moetune_grouped")
    qwen3 = MoEProblem(2048, 2048, 768, 128, 8)
    vllm = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
            "num_warps": 8, "num_stages": 4}
    params = kernel.from_gemm_configs(qwen3, vllm, {**vllm, "BLOCK_SIZE_M": 8})
    # GEMM1's 256 columns of gate and up become 128 of each; 4 stages of them would need
    # 4 x (128x64 + 2 x 64x128) x 2 B = 192 KiB: they fit, as do GEMM2's.
    assert params["g1_BLOCK_SIZE_N"] == 128 and params["g2_BLOCK_SIZE_N"] == 256
    assert params["g2_BLOCK_SIZE_M"] == 16 and params["REDUCE"] == "atomic_out"
    assert kernel.check_params(qwen3, params) is None
    # Weight tiles through TMA where the rows allow it (this machine has no GPU to refuse it),
    # by pointers where fp8 rows of 2040 B are not 16-byte aligned.
    assert params["W_TMA"] == 1
    unaligned = dataclasses.replace(qwen3, hidden_size=2040, quant="fp8_per_channel")
    assert kernel.from_gemm_configs(unaligned, vllm, vllm)["W_TMA"] == 0
    # And back: aiter's split family at the same tiles, which the search measures next.
    gemm1, gemm2 = kernel.gemm_configs(qwen3, params)
    assert gemm1 == vllm and gemm2 == {**vllm, "BLOCK_SIZE_M": 16}
    split = default_registry.get("aiter_triton_silu_fused")
    assert split.gemm_configs(qwen3, split.from_gemm_configs(qwen3, gemm1, gemm2)) == (gemm1, gemm2)
    assert default_registry.get("aiter_triton").from_gemm_configs(qwen3, gemm1, gemm2) is None
    ungated = dataclasses.replace(qwen3, activation="gelu", gated=False, dtype="float32")
    params = kernel.from_gemm_configs(ungated, vllm, vllm)
    assert params["g1_BLOCK_SIZE_N"] == 256 and params["REDUCE"] == "atomic"
    assert params["g1_num_stages"] < 4 and kernel.check_params(ungated, params) is None


# --- moetune_grouped_mm: torch's grouped GEMMs with Triton passes between them ------------------
grouped_mm_interpreted = pytest.mark.fresh_process("TRITON_INTERPRET",
                                                   "MOETUNE_GROUPED_MM_CHECKS")
# moetune_grouped_mm's gather, activation and ordered sum around torch's CPU grouped GEMM: top-1,
# top-k with experts no pair routes to (an empty group), the router weight on the input, ungated
# GELU and gated GELU, and H=72, I=40 (multiples of no Triton block).
GROUPED_MM_CASES = [
    MoEProblem(3, 64, 32, 8, 2, dtype="float32"),
    MoEProblem(5, 48, 40, 16, 1, dtype="float16", router_weight_on_input=True),
    MoEProblem(7, 64, 32, 8, 2, dtype="float32", activation="gelu", gated=False),
    MoEProblem(9, 72, 40, 32, 4, dtype="float16", activation="gelu"),
]


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_grouped_mm_checks_pass_in_a_fresh_process():
    _checks_pass_in_a_fresh_process("MOETUNE_GROUPED_MM_CHECKS", "grouped_mm",
                                    len(GROUPED_MM_CASES))


@grouped_mm_interpreted
@pytest.mark.parametrize("problem", GROUPED_MM_CASES, ids=_case_id)
def test_grouped_mm_kernel_matches_reference_interpreted(problem, cpu_sku):
    fn, batch, ref = _prepared("moetune_grouped_mm", {}, problem, cpu_sku)
    out = torch.full_like(batch.x, float("nan"))
    assert fn(*batch.args(), out=out) is out
    assert relative_error(out, ref) <= TOLERANCE[problem.dtype.value]


# --- slots routed nowhere (topk_ids -1) in the kernels that skip them ---------------------------
unrouted_interpreted = pytest.mark.fresh_process("TRITON_INTERPRET", "MOETUNE_UNROUTED_CHECKS")
# Each way a kernel's rows meet: moetune_grouped's three reduces, top-1's direct store, two
# block heights (two aligns), the sorted intermediate and the persistent GEMM2; moetune_decode's
# atomics, ordered split-K partials and top-1 store; moetune_decode_one's ordered reduce and
# top-1 store over several programs. The router weight on the input, gated or not.
UNROUTED_CASES = [
    ("moetune_grouped", MoEProblem(5, 64, 32, 8, 2, dtype="float32"), GROUPED),
    ("moetune_grouped", MoEProblem(7, 72, 40, 4, 3, dtype="float16"),
     {**GROUPED, "REDUCE": "atomic_out"}),
    ("moetune_grouped", MoEProblem(6, 64, 48, 8, 2, dtype="float32", activation="gelu",
                                   gated=False), {**GROUPED, "REDUCE": "sum"}),
    ("moetune_grouped", MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     GROUPED),
    ("moetune_grouped", MoEProblem(7, 72, 40, 4, 3, dtype="float16"),
     {**GROUPED, "g2_BLOCK_SIZE_M": 32, "REDUCE": "sum"}),
    ("moetune_grouped", MoEProblem(5, 64, 32, 8, 2, dtype="float32"),
     {**GROUPED, "g2_A_TMA": 1, "g2_PERSISTENT": 2, "REDUCE": "sum"}),
    ("moetune_decode", MoEProblem(3, 64, 32, 8, 2, dtype="float32"), DECODE),
    ("moetune_decode", MoEProblem(4, 64, 64, 8, 2, dtype="float32"),
     {**DECODE, "SPLIT_K": 2, "REDUCE": "ordered"}),
    ("moetune_decode", MoEProblem(3, 72, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     DECODE),
    ("moetune_decode", MoEProblem(3, 48, 40, 8, 3, dtype="float16", activation="gelu",
                                  gated=False), {**DECODE, "REDUCE": "atomic_out"}),
    ("moetune_decode_one", MoEProblem(4, 64, 32, 8, 2, dtype="float32"),
     {**ONE, "PROGRAMS_PER_SM": 4}),
    ("moetune_decode_one", MoEProblem(3, 72, 40, 8, 1, dtype="float16",
                                      router_weight_on_input=True), {**ONE, "PROGRAMS_PER_SM": 3}),
    ("moetune_decode_one", MoEProblem(3, 48, 40, 8, 3, dtype="float16", activation="gelu",
                                      gated=False), {**ONE, "PROGRAMS_PER_SM": 3}),
]


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_unrouted_checks_pass_in_a_fresh_process():
    _checks_pass_in_a_fresh_process("MOETUNE_UNROUTED_CHECKS", "unrouted",
                                    len(UNROUTED_CASES) + 2)


@unrouted_interpreted
@pytest.mark.parametrize("one_program", [True, False], ids=["one-launch", "three-launches"])
def test_align_leaves_unrouted_pairs_out_of_every_block(one_program):
    from moetune.runtime.kernels._align import ONE_PROGRAM_MAX, align

    gen = torch.Generator().manual_seed(0)
    for m, topk, e, block in ((3, 2, 8, 16), (37, 8, 256, 64), (300, 8, 128, 16)):
        ids = random_ids(m, topk, e, gen)
        ids[torch.rand(ids.shape, generator=gen) < 0.3] = -1
        ids[0] = -1
        for routing_ids in (ids, torch.full_like(ids, -1)):
            r = align(routing_ids, block, e,
                      one_program_max=ONE_PROGRAM_MAX if one_program else 0)
            check_routing(routing_ids, block, e, r)


@unrouted_interpreted
@pytest.mark.parametrize("name,problem,params", UNROUTED_CASES,
                         ids=lambda c: _case_id(c) if not isinstance(c, str) else c)
def test_unrouted_slots_contribute_nothing_interpreted(name, problem, params, cpu_sku):
    """Rows routed nowhere come out zero (their NaN activations unread), a row with one slot
    routed nowhere is the reference's without it, and a call routed nowhere at all (a CUDA
    graph's capture) gives zeros and leaves the next call right (counters, buffers)."""
    fn, batch, _ = _prepared(name, params, problem, cpu_sku)
    weights = make_weights(problem, "cpu", seed=1)
    reference = default_registry.get("reference").prepare(problem, {}, weights)
    for rows in ((), None):
        call, ref_call, empty = with_unrouted(*batch.args(), rows=rows)
        out = torch.full_like(batch.x, float("nan"))
        assert fn(*call, out=out) is out
        assert (out[empty] == 0).all() and empty.any()
        if not empty.all():
            assert relative_error(out, reference(*ref_call)) <= TOLERANCE[problem.dtype.value]
    out = fn(*batch.args())
    assert relative_error(out, reference(*batch.args())) <= TOLERANCE[problem.dtype.value]
