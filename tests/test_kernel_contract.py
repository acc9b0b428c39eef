"""The contract every registered kernel keeps, checked by being registered: at tiny shapes an
eligible kernel matches the float32 reference within the tuner's tolerance, both returning a new
tensor and writing into a given output (what serving passes), and an ineligible one says why,
starting with its name.

Run on this machine's device: the CPU here (and again under Triton's interpreter, in a fresh
process, where the Triton kernels become eligible in float32 and float16), every CUDA kernel on
a GPU. A new kernel needs no test of its own to be held to this.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from moetune.runtime.kernels.base import BaseKernel
from moetune.runtime.platform import SKU, detect_sku
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import KERNEL_PATHS, default_registry
from moetune.tuner.gate import relative_error, tolerance
from moetune.tuner.inputs import make_batch, make_weights
from tests.routing_checks import with_unrouted

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROBLEMS = [
    MoEProblem(5, 128, 128, 8, 2, dtype="float32"),
    MoEProblem(3, 128, 128, 8, 1, dtype="float16", router_weight_on_input=True),
    MoEProblem(4, 128, 128, 8, 2, dtype="float32", activation="gelu", gated=False),
    MoEProblem(4, 128, 128, 8, 2, dtype="float16", activation="gelu", gated=False),
    MoEProblem(6, 256, 128, 8, 2, dtype="bfloat16"),
    MoEProblem(4, 256, 128, 8, 2, dtype="bfloat16", quant="fp8_per_tensor"),
    MoEProblem(4, 256, 128, 8, 2, dtype="bfloat16", quant="fp8_per_channel"),
    MoEProblem(4, 256, 256, 8, 2, dtype="bfloat16", quant="fp8_block_128x128"),
]


@pytest.fixture(scope="module")
def sku() -> SKU:
    return detect_sku(DEVICE)


def _params(kernel: type[BaseKernel], problem: MoEProblem, sku: SKU) -> dict[str, Any] | None:
    """The kernel's seed, else the first parameter set in its space that fits ``problem``."""
    seed = kernel.seed_params(problem, sku)
    if seed is not None:
        return seed
    names = [p.name for p in kernel.params]
    for values in itertools.islice(itertools.product(*(p.choices for p in kernel.params)), 5000):
        params = dict(zip(names, values))
        if kernel.check_params(problem, params) is None:
            return params
    return None


#: Under the interpreter only the Triton kernels (``compiles``) become eligible: the others were
#: held to the contract by the outer pass already.
NAMES = [n for n in default_registry.names() if not INTERPRETED or default_registry.get(n).compiles]


@pytest.mark.parametrize("name", NAMES)
def test_every_registered_kernel_matches_the_reference_or_says_why_not(name, sku):
    kernel = default_registry.get(name)
    reference = default_registry.get("reference")
    for problem in PROBLEMS:
        ok, why = kernel.supports(problem, sku)
        if not ok:
            assert why and why.startswith(f"{name}: "), why
            continue
        params = _params(kernel, problem, sku)
        assert params is not None, f"{name}: nothing in its space fits {problem.describe()}"
        weights = make_weights(problem, DEVICE, seed=1)
        batch = make_batch(problem, DEVICE, seed=2)
        want = reference.prepare(problem, {}, weights)(*batch.args())
        fn = kernel.prepare(problem, kernel.validate(params), weights)
        got = fn(*batch.args())
        assert got.shape == batch.x.shape and got.dtype == batch.x.dtype, problem.describe()
        error = relative_error(got, want)
        assert error <= tolerance(problem, DEVICE), (problem.describe(), params, error)
        # NaN shows any element the kernel leaves unwritten or accumulates onto.
        out = torch.full_like(batch.x, float("nan"))
        assert fn(*batch.args(), out=out) is out, problem.describe()
        error = relative_error(out, want)
        assert error <= tolerance(problem, DEVICE), (problem.describe(), params, "out=", error)


@pytest.mark.parametrize("name", [n for n in NAMES if default_registry.get(n).skips_unrouted])
def test_every_kernel_skipping_unrouted_slots_matches_the_reference_without_them(name, sku):
    """A kernel declaring ``skips_unrouted`` takes slots routed nowhere (id -1) as they are:
    each row is the reference's without those slots, a row with none routed is zeros (its
    activations, NaN here, unread), and so is every row of a call routed nowhere at all (a
    CUDA graph's capture)."""
    kernel = default_registry.get(name)
    reference = default_registry.get("reference")
    for problem in PROBLEMS:
        if not kernel.supports(problem, sku)[0]:
            continue
        weights = make_weights(problem, DEVICE, seed=1)
        batch = make_batch(problem, DEVICE, seed=2)
        fn = kernel.prepare(problem, kernel.validate(_params(kernel, problem, sku)), weights)
        for rows in (None, ()):
            call, ref_call, empty = with_unrouted(*batch.args(), rows=rows)
            want = reference.prepare(problem, {}, weights)(*ref_call)
            out = torch.full_like(batch.x, float("nan"))
            assert fn(*call, out=out) is out, problem.describe()
            assert (out[empty] == 0).all(), (problem.describe(), rows)
            if not empty.all():
                error = relative_error(out, want)
                assert error <= tolerance(problem, DEVICE), (problem.describe(), error)


def test_every_kernel_path_names_its_class():
    """Tables and worker processes find a kernel by its path (``module:Class``)."""
    for name, path in KERNEL_PATHS.items():
        kernel = default_registry.get(name)
        assert kernel.name == name and f"{kernel.__module__}:{kernel.__qualname__}" == path


def test_the_reference_and_the_rules_kernels_run_here(sku):
    """Not every kernel may be eligible here, but these must be, so the test above checks
    something on every machine."""
    for problem in PROBLEMS[:2]:
        assert default_registry.get("reference").supports(problem, sku)[0]
        assert default_registry.get("torch_loop").supports(problem, sku)[0]


@pytest.mark.skipif(INTERPRETED or DEVICE != "cpu" or importlib.util.find_spec("triton") is None,
                    reason="the interpreted run is the CPU's second pass (needs triton)")
def test_triton_kernels_keep_the_contract_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "matches_the_reference"], env=env, capture_output=True, text=True,
                         timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
