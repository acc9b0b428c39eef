"""What the interpreted kernel tests (``test_interpret_*.py``) share: the tolerances, the devices
and preset shapes their eligibility checks use, a base config per moetune kernel, and the
fresh process their interpreted checks run in.

``triton.jit`` picks the interpreter when a kernel is *defined*, and modules are loaded once per
process, so each file's interpreted checks run in a fresh process that sets TRITON_INTERPRET=1
(and the file's own flag) before anything imports them: its outer test starts that process;
run there, they are ordinary tests (``fresh_process`` in ``tests/conftest.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from moetune.runtime.kernels.triton_config import with_prefix
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import default_registry
from moetune.tuner.gate import relative_error
from moetune.tuner.inputs import make_batch, make_weights

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not HAS_TRITON,
                                  reason="triton is not installed (pip install triton)")
outer_run = pytest.mark.skipif(INTERPRETED, reason="this is the outer run")

# The interpreter runs numpy: float32 is exact up to summation order, float16 rounds like the GPU.
TOLERANCE = {"float32": 1e-5, "float16": 1e-2}

H100 = SKU(Vendor.NVIDIA, "H100", "sm_90", 132, 80 << 30)
DECODE_SKUS = {"sm_90": H100, "sm_80": SKU(Vendor.NVIDIA, "A100", "sm_80", 108, 80 << 30),
               "sm_75": SKU(Vendor.NVIDIA, "T4", "sm_75", 40, 16 << 30),
               "gfx942": SKU(Vendor.AMD, "MI300X", "gfx942", 304, 192 << 30),
               "gfx950": SKU(Vendor.AMD, "MI355X", "gfx950", 256, 288 << 30),
               "gfx90a": SKU(Vendor.AMD, "MI250X", "gfx90a", 110, 64 << 30)}
# The shapes the decode kernels are for (TP8 where sharded): Llama-4-Maverick, DeepSeek-V3,
# Qwen3-30B-A3B.
DECODE_SHAPES = {
    "llama4": MoEProblem(1, 5120, 1024, 128, 1, quant="fp8_per_channel",
                         router_weight_on_input=True),
    "deepseek": MoEProblem(1, 7168, 256, 256, 8, quant="fp8_block_128x128"),
    "qwen3": MoEProblem(1, 2048, 768, 128, 8),
}

# A small config of each moetune kernel that fits the tiny shapes here.
DECODE = {"g1_BLOCK_N": 16, "g1_BLOCK_K": 64, "g1_num_warps": 4, "g1_num_stages": 2,
          "g2_BLOCK_N": 32, "g2_BLOCK_K": 32, "g2_num_warps": 4, "g2_num_stages": 2,
          "SPLIT_K": 1, "REDUCE": "atomic", "PDL": 0}
ONE = {"BLOCK_N1": 16, "BLOCK_K1": 64, "BLOCK_N2": 32, "BLOCK_K2": 32, "num_warps": 4,
       "num_stages": 2, "PROGRAMS_PER_SM": 1}
TILE = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1,
         "num_warps": 4, "num_stages": 2}
GROUPED = {**with_prefix(TILE, "g1_"), **with_prefix(TILE, "g2_"), "REDUCE": "atomic"}


def check_own_triton_devices(kernel, bf16: MoEProblem, block: MoEProblem, cpu_sku) -> None:
    """A moetune Triton kernel's eligibility by device for a bf16 and a block-fp8 problem:
    refused on this CPU without the interpreter; both on sm_90 and gfx950; bf16 alone on sm_80
    (fp8 needs sm_89) and gfx942 (its fp8 is e4m3fnuz); neither before sm_80 or on gfx90a."""
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


def case_id(case) -> str:
    return case.describe().replace(" ", "-") if isinstance(case, MoEProblem) else (
        "+".join(f"{k}={v}" for k, v in case.items()) or "base")


def checks_pass_in_a_fresh_process(test_file: str, flag: str, selection: str,
                                   expected: int) -> None:
    """Run ``test_file``'s checks matching ``selection`` interpreted, in a process that sets
    ``flag``; all ``expected`` of them must pass (none skipped by a mistyped selection)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", flag: "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                          selection, test_file], check=False, env=env, capture_output=True,
                         text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"{expected} passed" in run.stdout.strip().splitlines()[-1], run.stdout[-2000:]


def prepared(name: str, params: dict, problem: MoEProblem, cpu_sku) -> tuple:
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


def check_fp8_scales(name: str, params: dict, problem: MoEProblem, cpu_sku) -> None:
    """``name``, refused real fp8 weights here, matches the reference on float32 weights holding
    fp8 values with the scheme's scales, and misses it by far with GEMM2's scales left out.

    fp8 weights cannot run here, but their scales can: float32 weights holding the fp8 values,
    with the scheme's scales, go through the kernel's dequantization exactly as on the GPU (the
    reference multiplies the same values by the same scales). The tuner's weights give each
    group its own scale, so a scale read from the wrong row, block or expert fails."""
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


def check_tuner_gates(name: str, problem: MoEProblem, cpu_sku, params: dict | None = None):
    """The tuner offers ``name`` for ``problem`` here, its seed is valid, and its measurement
    (``params``, else the seed) passes the gate against the reference; returns the registry of
    the reference, the torch loop and ``name`` it used."""
    from moetune.runtime.registry import Registry
    from moetune.tuner.measure import Measurer, Status

    registry = Registry({n: p for n, p in default_registry.paths().items()
                         if n in ("reference", "torch_loop", name)})
    assert name in [k.name for k in registry.candidates(problem, cpu_sku)]
    kernel = registry.get(name)
    seed = kernel.seed_params(problem, cpu_sku)
    assert seed is not None and kernel.validate(seed) == seed
    result = Measurer(problem, "cpu", registry, reps=2).measure(name, params or seed)
    assert result.status is Status.OK and result.error <= 1e-5, result
    return registry
