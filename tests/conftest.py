"""Shared fixtures: the CPU SKU, small problems, and a tiny table tuned once per session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from moetune.runtime.platform import Vendor, detect_sku
from moetune.runtime.problem import MoEProblem
from moetune.tuner.job import JobOptions, run_job
from moetune.tuner.presets import preset

# Tables adopted on the machine running the tests (``moetune adopt``) must not stand in for the
# shipped ones the tests mean; vLLM processes the tests start inherit this too.
os.environ["MOETUNE_HOME"] = tempfile.mkdtemp(prefix="moetune-home-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect tests marked ``fresh_process(*flags)`` unless every flag is "1" here.

    Such tests run only inside the fresh process an outer test starts with those variables set
    (Triton picks its interpreter when a kernel is defined); outside it they are not this run's
    tests, so they are deselected rather than reported as skips.
    """
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("fresh_process")
        inside = marker is None or all(os.environ.get(flag) == "1" for flag in marker.args)
        (keep if inside else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def cpu_sku():
    return detect_sku("cpu")


@pytest.fixture
def plugin_serves_cpu() -> None:
    """Skip where the plugin would serve a GPU: a test handing vLLM's layers CPU tensors with a
    CPU table needs the plugin on the CPU, and vLLM's CPU build for the MoE ops it calls."""
    if detect_sku("auto").vendor is not Vendor.CPU:
        pytest.skip("the plugin serves this host's GPU, and vLLM's CUDA build has no CPU MoE ops")


@pytest.fixture
def small_problem() -> MoEProblem:
    return MoEProblem(num_tokens=24, hidden_size=64, intermediate_size=96, num_experts=8, topk=2,
                      dtype="float32")


@pytest.fixture(scope="session")
def tiny_table(tmp_path_factory, cpu_sku) -> Path:
    """The tiny preset tuned on this CPU at three buckets (what `moetune tune --preset tiny` does)."""
    path = tmp_path_factory.mktemp("tables") / "tiny.db"
    shape = preset("tiny").shape
    outcomes = run_job([shape.problem(m) for m in (1, 16, 64)], path, cpu_sku,
                       JobOptions(device="cpu", trials=8, reps=5))
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    return path


@pytest.fixture(scope="session")
def vllm_workspace():
    """vLLM's workspace manager on the GPU where there is one, else the CPU, as its model runner
    sets it up before any MoE call:
    the modular kernel of vLLM 0.33 and later takes its buffers from it. Growing a buffer
    empties the accelerator's cache first, which a machine without one cannot do (nothing to
    empty): that call does nothing here."""
    from vllm.v1.worker import workspace

    patch = pytest.MonkeyPatch()
    if not torch.accelerator.is_available():
        patch.setattr(torch.accelerator, "empty_cache", lambda: None)
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cuda" if torch.cuda.is_available()
                                                      else "cpu"))
    yield
    patch.undo()
