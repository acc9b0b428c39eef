"""vLLM's DeepGEMM MoE experts (``DeepGemmExperts``) on CUDA, run as vLLM runs a layer with them.

``DeepGemmExperts`` (``experts/deep_gemm_moe.py``, the same class in vLLM 0.32-0.34) runs the two
GEMMs of a 128 x 128 block-fp8 layer as DeepGEMM's contiguous grouped GEMMs
(``m_grouped_fp8_gemm_nt_contiguous``, JIT-compiled with nvcc on first use per shape), with
vLLM's own permute, fused SiLU-and-quantize and unpermute-and-reduce around them. vLLM serves a
layer with it through its fp8 oracle's DEEPGEMM backend, ``TritonOrDeepGemmExperts``, which on
Hopper under tensor parallelism is never the automatic pick (the oracle moves Triton first) but
is when DeepGEMM is asked for (``VLLM_USE_DEEP_GEMM=1`` set, ``--moe-backend deep_gemm``).

The weights it needs are not a checkpoint's: vLLM's fp8 method prepares them at load for that
backend (``convert_to_fp8_moe_kernel_format`` -> ``prepare_fp8_moe_layer_for_deepgemm``): where
DeepGEMM's E8M0 scales are in use (``is_deep_gemm_e8m0_used``: ``VLLM_USE_DEEP_GEMM_E8M0``, on by
default wherever DeepGEMM runs, Hopper included, where the scales then stay float32 but are
powers of two, ``FLOAT32_CEIL_UE8M0``) it requantizes the weights in place to power-of-two block
scales, and it always puts the scales in DeepGEMM's layout (``transform_sf_into_required_layout``).
``layer`` does exactly that, on a copy of moetune's plain weights, so the tuner times what
vLLM's DeepGEMM backend runs; a layer vLLM gave ``TritonExperts`` holds other weights (see
``moetune.runtime.kernels.vllm_deepgemm``).
"""

from __future__ import annotations

import functools
import importlib
import shutil
from types import SimpleNamespace

import torch

from moetune.runtime.problem import MoEProblem, QuantScheme
from moetune.runtime.vllm import triton
from moetune.runtime.vllm.classes import DEEP_GEMM

#: The block shape DeepGEMM's grouped GEMMs take on Hopper (vLLM asserts it equals DeepGEMM's
#: contiguous-layout alignment, which is 128 there).
BLOCK = (128, 128)


@functools.cache
def deepgemm_code() -> tuple[SimpleNamespace | None, str | None]:
    """vLLM's DeepGEMM MoE modules and class of the installed, supported vLLM, or why not.

    Imports only; whether DeepGEMM runs here is ``vllm_deepgemm``'s question."""
    code, why = triton.vllm_code()
    if code is None:
        return None, why
    try:
        from vllm import envs
        from vllm.model_executor.layers.fused_moe.experts import deep_gemm_moe
        from vllm.model_executor.layers.quantization.utils import fp8_utils
        from vllm.utils import deep_gemm

        experts = DEEP_GEMM.load()
    except Exception as e:  # noqa: BLE001 - any vLLM that differs (IncompatibleVllm too)
        return None, f"vLLM's DeepGEMM MoE could not be imported ({type(e).__name__}: {e})"
    return SimpleNamespace(triton=code, experts=experts, module=deep_gemm_moe, dg=deep_gemm,
                           envs=envs, fp8_utils=fp8_utils), None


@functools.cache
def vllm_deepgemm() -> tuple[SimpleNamespace | None, str | None]:
    """``deepgemm_code`` where DeepGEMM runs, with DeepGEMM's library loaded, or the exact
    reason it does not: vLLM's own answers (``support_deep_gemm``, ``VLLM_USE_DEEP_GEMM``,
    ``has_deep_gemm``, nvcc as DeepGEMM's JIT finds it, ``is_deep_gemm_supported``), in order."""
    code, why = deepgemm_code()
    if code is None:
        return None, why
    dg, platform = code.dg, code.triton.platform
    if not platform.is_cuda():
        return None, f"vLLM here runs on {type(platform).__name__}, and DeepGEMM needs CUDA"
    _, why = triton.vllm_triton()  # vLLM's compiled ops, which its prepare step runs
    if why:
        return None, why
    if not platform.support_deep_gemm():
        return None, ("vLLM runs DeepGEMM on Hopper (sm_90) and Blackwell only, device is "
                      f"{platform.get_device_name()}")
    if not code.envs.VLLM_USE_DEEP_GEMM:
        return None, "VLLM_USE_DEEP_GEMM=0 turns vLLM's DeepGEMM off"
    if not dg.has_deep_gemm():
        return None, ("DeepGEMM is not installed (neither deep_gemm nor vLLM's vendored "
                      "vllm.third_party.deep_gemm; scripts/vllm_device_pack.py --deepgemm)")
    if _nvcc(dg) is None:
        return None, ("DeepGEMM JIT-compiles its kernels with nvcc, which is not found "
                      "(CUDA_HOME, CUDA_PATH, PATH or /usr/local/cuda)")
    if not dg.is_deep_gemm_supported():
        return None, "vLLM's is_deep_gemm_supported() says no (DeepGEMM's JIT needs nvcc 12.9+)"
    dg._lazy_init()
    if dg._grouped_impl is None:
        return None, f"DeepGEMM's library did not load ({_import_error()})"
    return code, None


def _nvcc(dg: object) -> str | None:
    """The nvcc DeepGEMM's JIT would run: vLLM's own lookup where it has one (0.34), else
    nvcc on PATH or in CUDA_HOME (where DeepGEMM looks)."""
    find = getattr(dg, "_deep_gemm_nvcc_path", None)
    if find is not None:
        return find()
    import os

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return shutil.which("nvcc") or shutil.which(os.path.join(home, "bin", "nvcc"))


def _import_error() -> str:
    """Why DeepGEMM's module does not import (vLLM logs it and returns None)."""
    for name in ("deep_gemm", "vllm.third_party.deep_gemm"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                return f"{name}: {e}"
        except Exception as e:  # noqa: BLE001 - the library's own load error, reported
            return f"{name}: {type(e).__name__}: {e}"
        else:
            return f"{name} imports, but has no m_grouped_fp8_gemm_nt_contiguous"
    return "no DeepGEMM module"


def shape_reason(problem: MoEProblem) -> str | None:
    """Why DeepGEMM's grouped GEMMs cannot take ``problem``'s weights, by vLLM's own check
    (``_valid_deep_gemm_shape``: N and K multiples of DeepGEMM's contiguous-layout alignment);
    None if they can.

    Its other conditions are vLLM's per-call choice between DeepGEMM and Triton in
    ``TritonOrDeepGemmExperts``, not limits of the kernel: at least ``align`` tokens, and
    N > 512 (DeepSeek-V3 under TP8 has N = 256, which that choice gives Triton unless E8M0
    scales are in use, where vLLM runs DeepGEMM at every size). So the check is asked with
    ``align`` tokens.
    """
    code, why = deepgemm_code()
    if code is None:
        return why
    align = code.dg.get_mk_alignment_for_contiguous_layout()[0]
    n, k = problem.intermediate_size, problem.hidden_size
    if not code.module._valid_deep_gemm_shape(align, n, k):
        return (f"DeepGEMM needs intermediate and hidden sizes that are multiples of {align} "
                f"(vLLM's _valid_deep_gemm_shape), got {n} and {k}")
    return None


def held_weights(code: SimpleNamespace, w13: torch.Tensor, w2: torch.Tensor,
                 w13_scale: torch.Tensor, w2_scale: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weights and scales as vLLM's DEEPGEMM backend holds them after loading, made by
    vLLM's own ``prepare_fp8_moe_layer_for_deepgemm`` from a copy (it requantizes in place)."""
    return code.fp8_utils.prepare_fp8_moe_layer_for_deepgemm(
        w13.clone(), w2.clone(), w13_scale.clone(), w2_scale.clone(), BLOCK)


def layer(problem: MoEProblem, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
          w2_scale: torch.Tensor) -> triton.LayerFn:
    """vLLM's modular kernel with ``DeepGemmExperts`` for a block-fp8 layer of ``problem``
    holding these plain weights (converted once, here, as vLLM converts them at load).

    Raises:
        RuntimeError: DeepGEMM cannot run here (``vllm_deepgemm`` says why).
        ValueError: ``problem`` is not a 128 x 128 block-fp8 layer.
    """
    code, why = vllm_deepgemm()
    if code is None:
        raise RuntimeError(why)
    if problem.quant is not QuantScheme.FP8_BLOCK_128X128:
        raise ValueError(f"DeepGemmExperts runs 128x128 block fp8 only, not {problem.quant}")
    w13, w2, w13_scale, w2_scale = held_weights(code, w13, w2, w13_scale, w2_scale)
    return triton.modular(code.triton, code.experts, problem, w13, w2, w13_scale, w2_scale)
