"""``moetune_decode_one``, the one-launch decode kernel (persistent, counters between phases),
through Triton's interpreter on this CPU (``tests/interpreted.py``), and its eligibility."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.registry import default_registry
from moetune.tuner.gate import relative_error
from moetune.tuner.inputs import make_batch, make_weights
from tests.interpreted import (DECODE_SHAPES, H100, ONE, TOLERANCE, case_id, check_fp8_scales,
                               check_tuner_gates, checks_pass_in_a_fresh_process, needs_triton,
                               outer_run)

pytestmark = needs_triton

# The interpreter runs programs one after another; the launcher then makes the grid a divisor of
# the pairs so that each program owns whole pairs (it never waits on a later one). These checks
# cover the math, the work split over several programs, the ordered reduce and the counters'
# reset between calls; what they cannot cover is concurrency (memory ordering, residency): the
# CUDA tests do.
one_interpreted = pytest.mark.fresh_process("TRITON_INTERPRET", "MOETUNE_DECODE_ONE_CHECKS")
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


@outer_run
def test_one_launch_checks_pass_in_a_fresh_process():
    checks_pass_in_a_fresh_process(__file__, "MOETUNE_DECODE_ONE_CHECKS", "one_launch",
                                   len(ONE_CASES) + len(ONE_FP8_EMULATED) + 1)


@one_interpreted
@pytest.mark.parametrize("problem,override", ONE_CASES, ids=case_id)
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
@pytest.mark.parametrize("problem,override", ONE_FP8_EMULATED, ids=case_id)
def test_one_launch_kernel_applies_fp8_scales_interpreted(problem, override, cpu_sku):
    """float32 weights holding fp8 values, with the scheme's scales (see the decode test)."""
    check_fp8_scales("moetune_decode_one", {**ONE, **override}, problem, cpu_sku)


@one_interpreted
def test_tuner_offers_and_gates_the_one_launch_kernel_interpreted(cpu_sku):
    check_tuner_gates("moetune_decode_one", MoEProblem(2, 64, 32, 4, 2, dtype="float32"), cpu_sku)


@outer_run
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


@outer_run
def test_one_launch_grid_stays_resident_and_never_exceeds_the_work():
    from moetune.runtime.kernels._one_launch import grid_size

    assert grid_size(264, 8, 1536, False) == 264  # resident cap
    assert grid_size(264, 1, 40, False) == 40  # no program without an item
    assert grid_size(264, 8, 1536, True) == 8  # interpreter: programs own whole pairs
    assert grid_size(4, 6, 100, True) == 2
