"""The compile pool's memory: children hold one expert as every expert, the pool fits the free
memory, and a compile that runs out of memory is retried with fewer children, never blamed."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from moetune.runtime.kernels.base import BaseKernel, Param
from moetune.runtime.kernels.torch_dense import TorchDenseKernel
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import Registry
from moetune.tuner.inputs import Routing, make_batch, make_weights
from moetune.tuner.procs import compile_pool
from moetune.tuner.procs.compile_pool import (CompilePool, compile_inputs, fitting_workers,
                                              held_bytes)

BIG = MoEProblem(4, 1024, 256, 64, 8, dtype="bfloat16", quant="fp8_block_128x128")


def test_compile_inputs_hold_one_expert_with_the_real_shapes_strides_and_scales():
    real, batch = make_weights(BIG, "cpu", 0), make_batch(BIG, "cpu", 1)
    lean, lean_batch = compile_inputs(BIG, "cpu", 0, Routing.UNIFORM)
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        a, b = getattr(real, name), getattr(lean, name)
        assert (a.shape, a.dtype, a.stride()[1:]) == (b.shape, b.dtype, b.stride()[1:]), name
    for name in ("w13", "w2"):  # Triton keys an integer on divisibility by 16: 0 is like N*K
        assert getattr(lean, name).stride(0) == 0 and getattr(real, name).stride(0) % 16 == 0
    for name in ("w13_scale", "w2_scale"):  # small: kept whole, with the real strides
        assert getattr(lean, name).stride() == getattr(real, name).stride()
    assert all(torch.equal(x, y) for x, y in zip(batch.args(), lean_batch.args()))
    expert = sum(t[0].numel() * t.element_size() for t in (real.w13, real.w2))
    scales = sum(t.numel() * 4 for t in (real.w13_scale, real.w2_scale))
    assert held_bytes(lean, lean_batch) == expert + scales + batch.nbytes()
    assert held_bytes(real, batch) > 40 * held_bytes(lean, lean_batch)


def test_a_kernel_runs_on_compile_inputs():
    problem = MoEProblem(6, 64, 32, 8, 2, dtype="float32")
    weights, batch = compile_inputs(problem, "cpu", 0, Routing.UNIFORM)
    out = TorchDenseKernel.prepare(problem, {"chunk_tokens": 512}, weights)(*batch.args())
    assert out.shape == (6, 64) and torch.isfinite(out).all()


def test_the_pool_fits_the_free_host_memory(monkeypatch, caplog):
    monkeypatch.setattr(compile_pool, "_host_available",
                        lambda: 5 * compile_pool.CHILD_HOST_BYTES)
    with caplog.at_level(logging.WARNING, logger="moetune"):
        assert fitting_workers(8, BIG, "cpu") == 4
    assert "4 compile workers instead of 8" in caplog.text
    monkeypatch.setattr(compile_pool, "_host_available", lambda: 0)
    assert fitting_workers(8, BIG, "cpu") == 1  # serial, never none
    monkeypatch.setattr(compile_pool, "_host_available", lambda: None)
    assert fitting_workers(8, BIG, "cpu") == 8


class OutOfMemoryWhenCrowdedKernel(BaseKernel):
    """Runs out of memory while a sibling compile child is alive (as a GPU shared by too many
    children would), runs alone."""

    name = "oom_when_crowded"
    params = (Param("variant", ("a", "b", "c")),)

    @classmethod
    def _supports_device(cls, problem, sku):
        return None

    @classmethod
    def prepare(cls, problem, params, weights):
        def run(x, w, ids):
            if os.environ.get("MOETUNE_TEST_CROWDED_FILE"):
                with open(os.environ["MOETUNE_TEST_CROWDED_FILE"]) as f:
                    alive = json.load(f)
                if alive > 1:
                    raise torch.OutOfMemoryError("CUDA out of memory (test)")
            return torch.zeros_like(x)
        return run


def test_compiles_out_of_memory_are_retried_with_fewer_children_and_blame_no_candidate(
        small_problem, tmp_path, monkeypatch):
    crowded = tmp_path / "alive.json"
    monkeypatch.setenv("MOETUNE_TEST_CROWDED_FILE", str(crowded))
    reg = Registry()
    reg.add(OutOfMemoryWhenCrowdedKernel)
    pool = CompilePool(small_problem, "cpu", reg, workers=2, timeout_s=120)
    try:
        crowded.write_text("2")
        original = pool._shrink

        def shrink():
            original()
            crowded.write_text(json.dumps(pool.workers))

        monkeypatch.setattr(pool, "_shrink", shrink)
        candidates = [("oom_when_crowded", {"variant": v}) for v in "abc"]
        assert pool.compile(candidates) == [None, None, None]
        assert pool.workers == 1 and len(pool._children) == 1
        crowded.write_text("2")  # one child still out of memory: left to the measurer
        assert pool.compile(candidates[:1]) == [None]
    finally:
        pool.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's cache key needs a GPU")
def test_compile_inputs_give_the_binaries_the_measurer_loads(tmp_path):
    """A config compiled on compile inputs is loaded, not compiled again, on the real weights:
    the Triton cache gains no binary from the second process."""
    script = (
        "import sys, torch\n"
        "from moetune.runtime.problem import MoEProblem\n"
        "from moetune.runtime.registry import default_registry\n"
        "from moetune.runtime.platform import detect_sku\n"
        "from moetune.runtime.rules import rule_choice\n"
        "from moetune.tuner.inputs import Routing, make_weights, make_batch\n"
        "from moetune.tuner.procs.compile_pool import compile_inputs\n"
        "p = MoEProblem(64, 2048, 768, 128, 8, dtype='bfloat16')\n"
        "rule = rule_choice(p, detect_sku('cuda'))\n"
        "if sys.argv[1] == 'lean':\n"
        "    w, b = compile_inputs(p, 'cuda', 0, Routing.UNIFORM)\n"
        "else:\n"
        "    w, b = make_weights(p, 'cuda', 0), make_batch(p, 'cuda', 1)\n"
        "default_registry.get(rule.kernel).prepare(p, rule.params, w)(*b.args())\n"
        "torch.cuda.synchronize()\n")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}

    def binaries() -> set[str]:
        return {str(p) for p in (tmp_path / "cache").rglob("*.cubin")}

    subprocess.run([sys.executable, "-c", script, "lean"], env=env, check=True)
    compiled = binaries()
    assert compiled
    subprocess.run([sys.executable, "-c", script, "real"], env=env, check=True)
    assert binaries() == compiled
