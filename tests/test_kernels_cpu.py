"""Every kernel eligible on this CPU computes the MoE layer like the float32 reference."""

import subprocess
import sys
import textwrap

import pytest
import torch

from moetune.errors import InvalidParamsError, UnknownKernelError
from moetune.runtime.kernels.base import Param
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import Registry, default_registry
from moetune.tuner.gate import relative_error, tolerance
from moetune.tuner.inputs import Routing, make_batch, make_weights

CPU_KERNELS = ["torch_loop", "torch_grouped", "torch_dense"]
PROBLEMS = [
    MoEProblem(1, 64, 96, 8, 2, dtype="float32"),
    MoEProblem(37, 72, 40, 16, 4, dtype="float32", activation="gelu"),
    MoEProblem(29, 64, 96, 4, 1, dtype="bfloat16", router_weight_on_input=True),
    MoEProblem(50, 64, 48, 8, 8, dtype="float16", gated=False),
]


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.describe())
@pytest.mark.parametrize("name", CPU_KERNELS)
def test_kernel_matches_reference(name, problem, cpu_sku):
    kernel = default_registry.get(name)
    assert kernel.supports(problem, cpu_sku) == (True, None)
    weights = make_weights(problem, "cpu", seed=1)
    batch = make_batch(problem, "cpu", seed=2, routing=Routing.ZIPF)
    ref = default_registry.get("reference").prepare(problem, {}, weights)(*batch.args())
    for choice in (kernel.params[0].choices if kernel.params else [None]):
        params = {kernel.params[0].name: choice} if kernel.params else {}
        out = kernel.prepare(problem, params, weights)(*batch.args())
        assert out.dtype == batch.x.dtype and out.shape == batch.x.shape
        assert relative_error(out, ref) <= tolerance(problem), (name, params)


def test_reference_is_not_a_candidate_and_fp8_runs_on_the_dequantizing_torch_kernels(cpu_sku):
    p = MoEProblem(4, 128, 256, 8, 2, quant="fp8_per_tensor")
    verdicts = default_registry.eligibility(p, cpu_sku)
    assert verdicts["reference"] is None
    assert "fp8_per_tensor" in verdicts["torch_dense"]
    assert [k.name for k in default_registry.candidates(p, cpu_sku)] == ["torch_loop",
                                                                          "torch_grouped"]


def test_dense_kernel_refuses_many_experts(cpu_sku):
    ok, why = default_registry.get("torch_dense").supports(MoEProblem(4, 64, 64, 128, 2), cpu_sku)
    assert not ok and "128 experts" in why


def test_params_are_validated_against_the_declared_space():
    dense = default_registry.get("torch_dense")
    assert dense.validate({"chunk_tokens": 32}) == {"chunk_tokens": 32}
    for bad in ({"chunk_tokens": 33}, {}, {"chunk_tokens": 32, "x": 1}, {"chunk_tokens": True},
                ["chunk_tokens"]):
        with pytest.raises(InvalidParamsError):
            dense.validate(bad)


def test_registry_rejects_unknown_names_with_the_list():
    with pytest.raises(UnknownKernelError, match="torch_loop"):
        default_registry.get("nope")
    broken = Registry({"ghost": "moetune.runtime.kernels.does_not_exist:Ghost"})
    with pytest.raises(UnknownKernelError, match="optional dependency"):
        broken.get("ghost")


def test_every_declared_space_is_finite_and_hashable():
    for kernel in default_registry:
        for p in kernel.params:
            assert isinstance(p, Param) and p.choices and len(set(p.choices)) == len(p.choices)
        assert kernel.space_size() >= 1


# A fresh process whose first AMX instruction is vLLM's MoE op, as in a tune or a benchmark.
_FIRST_AMX = textwrap.dedent("""
    from moetune.runtime.problem import MoEProblem
    from moetune.runtime.registry import default_registry
    from moetune.tuner.gate import relative_error
    from moetune.tuner.inputs import make_batch, make_weights
    problem = MoEProblem(4, 256, 128, 8, 2)
    kernel = default_registry.get("vllm_cpu_experts")
    assert kernel.isa(problem) == "amx", kernel.isa(problem)
    weights = make_weights(problem, "cpu", seed=1)
    batch = make_batch(problem, "cpu", seed=2)
    out = kernel.prepare(problem, {}, weights)(*batch.args())  # before any torch matmul
    ref = default_registry.get("reference").prepare(problem, {}, weights)(*batch.args())
    print(relative_error(out, ref))
""")


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX tiles")
def test_vllm_cpu_kernel_asks_for_amx_before_running_it(cpu_sku):
    """Linux kills a process with SIGILL at its first AMX instruction unless it asked for the
    tile state first; torch asks on its first AMX matmul, vLLM's MoE ops do not."""
    problem = MoEProblem(4, 256, 128, 8, 2)
    ok, why = default_registry.get("vllm_cpu_experts").supports(problem, cpu_sku)
    if not ok:
        pytest.skip(f"vLLM's CPU kernel does not run here: {why}")
    run = subprocess.run([sys.executable, "-c", _FIRST_AMX], capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert float(run.stdout.split()[-1]) <= tolerance(problem)
