"""``moetune_decode``, the small-M kernel (two launches, no routing step), through Triton's
interpreter on this CPU (``tests/interpreted.py``), and its eligibility and constraints."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.registry import default_registry
from moetune.tuner.gate import relative_error
from tests.interpreted import (DECODE, DECODE_SHAPES, H100, TOLERANCE, case_id, check_fp8_scales,
                               check_own_triton_devices, check_tuner_gates,
                               checks_pass_in_a_fresh_process, needs_triton, outer_run, prepared)

pytestmark = needs_triton

decode_interpreted = pytest.mark.fresh_process("TRITON_INTERPRET", "MOETUNE_DECODE_CHECKS")
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

@outer_run
def test_decode_checks_pass_in_a_fresh_process():
    checks_pass_in_a_fresh_process(__file__, "MOETUNE_DECODE_CHECKS", "decode",
                                   len(DECODE_CASES) + len(FP8_EMULATED) + 1)


@decode_interpreted
@pytest.mark.parametrize("problem,override", DECODE_CASES, ids=case_id)
def test_decode_kernel_matches_reference_interpreted(problem, override, cpu_sku):
    fn, batch, ref = prepared("moetune_decode", {**DECODE, **override}, problem, cpu_sku)
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

@decode_interpreted
@pytest.mark.parametrize("problem,override", FP8_EMULATED, ids=case_id)
def test_decode_kernel_applies_fp8_scales_interpreted(problem, override, cpu_sku):
    check_fp8_scales("moetune_decode", {**DECODE, **override}, problem, cpu_sku)


@decode_interpreted
def test_tuner_offers_and_gates_the_decode_kernel_interpreted(cpu_sku):
    problem = MoEProblem(1, 64, 32, 4, 2, dtype="float32")
    registry = check_tuner_gates("moetune_decode", problem, cpu_sku,
                                 dict(DECODE, g1_BLOCK_N=32, g2_BLOCK_N=64))
    assert not registry.get("moetune_decode").supports(problem.with_tokens(129), cpu_sku)[0]


@outer_run
def test_decode_eligibility_names_devices_schemes_and_sizes(cpu_sku):
    kernel = default_registry.get("moetune_decode")
    bf16, block = DECODE_SHAPES["qwen3"], DECODE_SHAPES["deepseek"]
    check_own_triton_devices(kernel, bf16, block, cpu_sku)
    assert kernel.supports(bf16.with_tokens(32), H100) == (True, None)  # 32 x 8 = 256 pairs
    ok, why = kernel.supports(bf16.with_tokens(33), H100)
    assert not ok and "264 > 256" in why


@outer_run
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=str)
def test_decode_seeds_fit_every_scheme_and_decode_size(shape):
    kernel = default_registry.get("moetune_decode")
    for quant, m in itertools.product(QuantScheme, (1, 2, 4, 8, 16, 32)):
        problem = dataclasses.replace(DECODE_SHAPES[shape], quant=quant, num_tokens=m)
        seed = kernel.seed_params(problem, H100)
        assert seed is not None and kernel.validate(seed) == seed, (problem.describe(), seed)
        assert kernel.check_params(problem, seed) is None


@outer_run
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


@outer_run
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
