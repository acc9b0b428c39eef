"""vLLM's own Triton fused-MoE path on CUDA, run as vLLM runs a layer with it.

What vLLM 0.32-0.34 serves an unquantized or fp8 layer with on Hopper under tensor parallelism
(``oracle/unquantized.py`` and ``oracle/fp8.py`` rank Triton first there): ``TritonExperts``
inside its modular kernel (``FusedMoEKernel``) behind the no-DP prepare step, which quantizes
fp8 layers' activations and applies a top-1 router weight to the input. ``TritonExperts``
looks its configs up itself (its tuned files, in 0.34 GEMM2's ``_down.json`` with ``USE_TMA``,
else its default heuristic) and runs vLLM's compiled align, activation and top-k sum between
the GEMMs. Nothing here re-implements any of that: it builds vLLM's objects and calls them, so
the CUDA rule's pick is vLLM's code of the installed version, not an emulation of it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.vllm import versions
from moetune.runtime.vllm.classes import TRITON

#: The compiled ops ``TritonExperts`` calls between its GEMMs (``_custom_ops``), by namespace.
OPS = (("_C", "silu_and_mul"), ("_moe_C", "moe_align_block_size"), ("_moe_C", "moe_sum"))

#: ``fn(hidden_states, topk_weights, topk_ids) -> output``, the layer as vLLM computes it.
LayerFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def vllm_code() -> tuple[SimpleNamespace | None, str | None]:
    """vLLM's Triton MoE modules and classes of the installed, supported vLLM, or why not.

    Imports only; whether they can run here is ``vllm_triton``'s question."""
    if importlib.util.find_spec("vllm") is None:
        return None, "vLLM is not installed"
    why = versions.unsupported(versions.installed())
    if why:
        return None, why
    try:
        import vllm.model_executor.layers.fused_moe as package
        from vllm.model_executor.layers.fused_moe import config, fused_moe, modular_kernel
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.prepare_finalize import no_dp_ep
        from vllm.platforms import current_platform

        experts = TRITON.load()
    except Exception as e:  # noqa: BLE001 - any vLLM that differs (IncompatibleVllm too)
        return None, f"vLLM's Triton MoE could not be imported ({type(e).__name__}: {e})"
    return SimpleNamespace(package=package, config=config, fused_moe=fused_moe,
                           modular_kernel=modular_kernel,
                           activation=MoEActivation, no_dp_ep=no_dp_ep, experts=experts,
                           platform=current_platform,
                           version=versions.installed()), None


@functools.cache
def vllm_triton() -> tuple[SimpleNamespace | None, str | None]:
    """``vllm_code`` where it runs: vLLM's CUDA platform with its compiled ops loaded."""
    code, why = vllm_code()
    if code is None:
        return None, why
    if not code.platform.is_cuda():
        return None, (f"vLLM here runs on {type(code.platform).__name__}, and its Triton MoE "
                      "path needs CUDA")
    code.platform.import_kernels()
    missing = [f"{ns}.{op}" for ns, op in OPS if not hasattr(getattr(torch.ops, ns), op)]
    if missing:
        return None, f"vLLM's compiled ops {', '.join(missing)} are not loaded"
    return code, None


def moe_config(code: SimpleNamespace, problem: MoEProblem, device: torch.device) -> Any:
    """vLLM's ``FusedMoEConfig`` of a layer of ``problem``'s shape, unsharded as moetune sees it
    (``problem`` is already one rank's shard)."""
    experts = problem.num_experts
    return code.config.FusedMoEConfig(
        num_experts=experts, experts_per_token=problem.topk, hidden_dim=problem.hidden_size,
        intermediate_size=problem.intermediate_size, num_local_experts=experts,
        num_logical_experts=experts, activation=code.activation(problem.activation.value),
        device=device, routing_method=code.config.RoutingMethodType.Renormalize,
        moe_parallel_config=code.config.FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=getattr(torch, problem.dtype.value))


def quant_config(code: SimpleNamespace, problem: MoEProblem, w13_scale: torch.Tensor | None,
                 w2_scale: torch.Tensor | None) -> Any:
    """The ``FusedMoEQuantConfig`` vLLM's fp8 method builds for such a layer, around scales in
    moetune's layout (per channel (E, N) is vLLM's (E, N, 1); serving/quant.py reads it back)."""
    quant = problem.quant
    if quant is QuantScheme.NONE:
        return code.config.FUSED_MOE_UNQUANTIZED_CONFIG
    fp8 = code.config.fp8_w8a8_moe_quant_config
    if quant is QuantScheme.FP8_BLOCK_128X128:
        return fp8(w1_scale=w13_scale, w2_scale=w2_scale, block_shape=[128, 128])
    if quant is QuantScheme.FP8_PER_CHANNEL:
        return fp8(w1_scale=w13_scale.unsqueeze(-1), w2_scale=w2_scale.unsqueeze(-1),
                   per_act_token_quant=True, per_out_ch_quant=True)
    return fp8(w1_scale=w13_scale, w2_scale=w2_scale)  # per tensor, dynamic activations


def layer(problem: MoEProblem, w13: torch.Tensor, w2: torch.Tensor,
          w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None) -> LayerFn:
    """vLLM's modular kernel for a layer of ``problem`` holding these weights, as a function.

    Raises:
        RuntimeError: vLLM's Triton path cannot run here (``vllm_triton`` says why).
    """
    code, why = vllm_triton()
    if code is None:
        raise RuntimeError(why)
    return modular(code, code.experts, problem, w13, w2, w13_scale, w2_scale)


def modular(code: SimpleNamespace, experts_class: type, problem: MoEProblem, w13: torch.Tensor,
            w2: torch.Tensor, w13_scale: torch.Tensor | None,
            w2_scale: torch.Tensor | None) -> LayerFn:
    """``experts_class`` (``TritonExperts`` or another of vLLM's experts classes) in vLLM's
    modular kernel behind its no-DP prepare step, for a layer of ``problem`` holding these
    weights as that class expects them, as a function."""
    workspace(w13.device)
    experts = experts_class(moe_config(code, problem, w13.device),
                            quant_config(code, problem, w13_scale, w2_scale))
    kernel = code.modular_kernel.FusedMoEKernel(
        code.no_dp_ep.MoEPrepareAndFinalizeNoDPEPModular(), experts)
    activation = code.activation(problem.activation.value)
    num_experts, on_input = problem.num_experts, problem.router_weight_on_input

    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return kernel.apply(x, w13, w2, topk_weights, topk_ids, activation, num_experts, None,
                            on_input)

    return run


@contextlib.contextmanager
def config_override(config: dict[str, int]) -> Iterator[None]:
    """Every Triton MoE launch of vLLM inside runs ``config``, GEMM1 and GEMM2 alike: vLLM's
    public ``override_config``, which ``try_get_optimal_moe_config`` reads before its tuned
    files and default heuristic (0.32-0.34 alike). Under it 0.34's ``TritonExperts`` reads no
    ``_down.json`` and so never takes its sorted-A TMA GEMM2 (``VllmFacts.down_configs``).

    vLLM's own context manager restores the previous config only when its body returns (it has
    no ``try``/``finally``): here it is left without the body's exception, so a launch that
    raises leaves vLLM's configs as they were. The setting is one module global, as vLLM's
    engine runs one forward per process at a time.

    Raises:
        RuntimeError: vLLM's Triton MoE code is not importable here.
    """
    code, why = vllm_code()
    if code is None:
        raise RuntimeError(why)
    override = code.package.override_config(config)
    override.__enter__()
    try:
        yield
    finally:
        override.__exit__(None, None, None)


def config_choice(problem: MoEProblem) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The GEMM1 config vLLM's ``TritonExperts`` runs ``problem`` with here, and GEMM2's from a
    ``_down.json`` file (None where vLLM reads none): vLLM's own lookup, as its ``apply`` calls
    it: what the tests hold moetune's own reading of vLLM's files (``configs``) to.

    Raises:
        RuntimeError: vLLM's Triton MoE code is not importable here.
    """
    code, why = vllm_code()
    if code is None:
        raise RuntimeError(why)
    fm = code.fused_moe
    dtype = "fp8_w8a8" if problem.quant.is_fp8 else None
    block = [128, 128] if problem.quant is QuantScheme.FP8_BLOCK_128X128 else None
    n2, hidden = 2 * problem.intermediate_size, problem.hidden_size
    w1 = (problem.num_experts, n2 if problem.gated else problem.intermediate_size, hidden)
    w2 = (problem.num_experts, hidden, problem.intermediate_size)
    config = fm.try_get_optimal_moe_config(w1, w2, problem.topk, dtype, problem.num_tokens,
                                           block_shape=block)
    down = None
    if versions.installed_facts().down_configs and block is not None:
        found = fm.get_moe_configs(problem.num_experts, problem.intermediate_size, dtype, 128,
                                   128, down_moe=True)
        if found:
            down = dict(found[min(found, key=lambda m: abs(m - problem.num_tokens))])
    return dict(config), down


def workspace(device: torch.device) -> None:
    """vLLM's workspace manager, as its model runner sets it up before any MoE call (the
    modular kernel of 0.33 and later takes its buffers from it)."""
    try:
        from vllm.v1.worker import workspace as manager
    except ImportError:  # 0.32 allocates its own
        return
    if not manager.is_workspace_manager_initialized():
        manager.init_workspace_manager(device)
