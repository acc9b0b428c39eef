"""aiter's Triton MoE path on this CPU through Triton's interpreter, in float32 and float16 at tiny
shapes: routing alignment, every aiter kernel against the reference, and CPU eligibility. The
interpreted checks run in a fresh process the outer test starts (``tests/interpreted.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moetune.runtime.kernels.triton_config import with_prefix
from moetune.runtime.vllm.configs import vllm_default_config
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import default_registry
from moetune.tuner.gate import relative_error
from moetune.tuner.inputs import make_batch, make_weights
from tests.interpreted import TOLERANCE, needs_triton, outer_run
from tests.routing_checks import check_routing, random_ids

pytestmark = needs_triton

interpreted = pytest.mark.fresh_process("TRITON_INTERPRET")
# aiter's fused GELU is the tanh approximation (~2e-4 from exact GELU on these inputs).
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


@outer_run
def test_interpreted_checks_pass_in_a_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         check=False, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


@outer_run
def test_aiter_kernels_need_a_gpu_without_the_interpreter(cpu_sku):
    problem = MoEProblem(4, 64, 32, 8, 2, dtype="float32")
    for name in ("aiter_triton", "aiter_triton_split", "aiter_triton_silu_fused", "aiter_triton_e2e",
                 "aiter_triton_persistent", "aiter_triton_silu_fused_persistent"):
        ok, why = default_registry.get(name).supports(problem, cpu_sku)
        assert not ok and "GPU" in why, why


@outer_run
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
