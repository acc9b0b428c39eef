"""The Triton fused-MoE config space (vLLM's tuning grid), its shared-memory constraint, and
vLLM's ``get_default_config`` heuristic: the config CUDA serving runs when no tuned file exists."""

from __future__ import annotations

import functools
from typing import Any

from moetune.runtime.kernels.base import Param, invalid_params
from moetune.runtime.platform import SKU
from moetune.runtime.problem import DType, MoEProblem, QuantScheme
from moetune.runtime.vllm_configs import config_folders, tuned_config

#: vLLM's ``get_configs_compute_bound`` grid for CUDA (1920 points); configs export to its JSON.
SPACE: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128, 256),
    "BLOCK_SIZE_N": (32, 64, 128, 256),
    "BLOCK_SIZE_K": (64, 128, 256),
    "GROUP_SIZE_M": (1, 16, 32, 64),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4, 5),
}

#: Values vLLM's shipped tuned files use beyond that grid: valid in a config, not searched.
VLLM_FILE_EXTRA: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (8,),
    "BLOCK_SIZE_K": (32,),
    "GROUP_SIZE_M": (2, 4, 8, 128),
    "num_warps": (2, 16),
    "num_stages": (1, 6, 7, 8),
}

#: fp8 block quantization's (block_n, block_k).
QUANT_BLOCK = (128, 128)

# Opt-in shared memory per block on sm_90 (H100/H200), the tuning target; used without a GPU.
_HOPPER_SMEM_BYTES = 232448

_DTYPE_BYTES = {DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2}


def config_params(prefix: str = "", space: dict[str, tuple[int, ...]] = SPACE,
                  extra: dict[str, tuple[int, ...]] = VLLM_FILE_EXTRA) -> tuple[Param, ...]:
    """``space`` as kernel parameters, names prefixed (``g1_``) when a kernel holds several."""
    return tuple(Param(prefix + name, choices, extra.get(name, ()))
                 for name, choices in space.items())


def config_of(params: dict[str, Any], prefix: str = "",
              space: dict[str, tuple[int, ...]] = SPACE) -> dict[str, int]:
    """The Triton launch config (vLLM's key names) inside a kernel's parameters."""
    return {name: params[prefix + name] for name in space}


def with_prefix(config: dict[str, int], prefix: str) -> dict[str, int]:
    return {prefix + name: value for name, value in config.items()}


def operand_bytes(problem: MoEProblem) -> int:
    """Bytes per element of the GEMM operands: fp8 schemes quantize activations too."""
    return 1 if problem.quant.is_fp8 else _DTYPE_BYTES[problem.dtype]


@functools.cache
def shared_memory_limit() -> int:
    """Opt-in shared memory per block of the current GPU (Hopper's when there is none)."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(getattr(props, "shared_memory_per_block_optin", _HOPPER_SMEM_BYTES))
    return _HOPPER_SMEM_BYTES


def shared_memory_bytes(block_m: int, block_n: int, block_k: int, num_stages: int,
                        element_bytes: int) -> int:
    """What Triton's software pipeline keeps in shared memory: ``num_stages`` A and B tiles.
    The epilogue reuses the same memory once the main loop is done."""
    return num_stages * (block_m * block_k + block_k * block_n) * element_bytes


def check_config(problem: MoEProblem, config: dict[str, int]) -> str | None:
    """None if ``config`` can compile and compute ``problem`` correctly, else why not."""
    need = shared_memory_bytes(config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"],
                               config["BLOCK_SIZE_K"], config["num_stages"], operand_bytes(problem))
    if need > shared_memory_limit():
        return f"needs {need} B of shared memory, the GPU has {shared_memory_limit()} B per block"
    # The block-fp8 GEMM loads one activation scale per K step: a step must not span two blocks.
    if problem.quant is QuantScheme.FP8_BLOCK_128X128 and QUANT_BLOCK[1] % config["BLOCK_SIZE_K"]:
        return f"BLOCK_SIZE_K={config['BLOCK_SIZE_K']} spans two {QUANT_BLOCK[1]}-wide scale blocks"
    return None


def vllm_default_config(problem: MoEProblem) -> dict[str, int]:
    """vLLM's ``get_default_config`` on CUDA (fused_moe.py, PR #34846 and the block-fp8 decode
    tiles after it), for M = num_tokens. The tuned-table baseline every CUDA winner is measured
    against. Per-channel fp8 is ``fp8_w8a8`` without a block shape: the general branch."""
    m, e = problem.num_tokens, problem.num_experts
    if problem.quant is QuantScheme.FP8_BLOCK_128X128:
        block_n, block_k = QUANT_BLOCK
        if m <= 8 and block_n % 64 == 0:
            block_n, num_stages = 64, 4 if m <= 4 else 3
        else:
            num_stages = 3
        return {
            "BLOCK_SIZE_M": 16 if m <= 64 else 64,
            "BLOCK_SIZE_N": block_n,
            "BLOCK_SIZE_K": block_k,
            "GROUP_SIZE_M": 1 if m <= 16 else 32,
            "num_warps": 4,
            "num_stages": num_stages,
        }
    if m <= 32:
        block_m = 16
    elif m <= 96:
        block_m = 32
    elif m <= 512:
        block_m = 64
    else:
        block_m = 128
    return {
        "BLOCK_SIZE_M": block_m,
        "BLOCK_SIZE_N": 64 if m <= 64 else 128,
        "BLOCK_SIZE_K": 128 if problem.quant.is_fp8 or m <= 64 else 64,
        "GROUP_SIZE_M": 16 if m // e > 128 else 1,
        "num_warps": 4 if m <= 128 else 8,
        "num_stages": 4 if m <= 32 else 3,
    }


def vllm_config(problem: MoEProblem, sku: SKU) -> tuple[dict[str, int], str]:
    """The config vLLM runs for ``problem`` on ``sku`` (``try_get_optimal_moe_config``: its
    tuned file's nearest entry, else ``get_default_config``), and where it came from."""
    return vllm_config_variants(problem, sku)[0]


def vllm_config_variants(problem: MoEProblem, sku: SKU) -> list[tuple[dict[str, int], str]]:
    """Every config vLLM may run for ``problem`` on ``sku``, depending on what the user has:
    the tuned entry of each folder vLLM looks in (``VLLM_TUNED_CONFIG_FOLDER``, its shipped
    ``configs``), then its default config. The first is what vLLM runs here; duplicates are
    dropped, so a table tuned with one setup can be trusted under the others."""
    variants: list[tuple[dict[str, int], str]] = []
    for folder in config_folders():
        tuned = tuned_config(problem, sku, (folder,))
        if tuned is None:
            continue
        config, path, m = tuned
        if config.get("num_ctas") == 1:  # Triton's default, which the aiter launch uses anyway
            del config["num_ctas"]
        why = invalid_params(config_params(), config)
        if why:
            if not variants:
                variants.append((vllm_default_config(problem), (
                    f"its default config; the entry M={m} of its tuned file {path.name} cannot "
                    f"run here ({why})")))
            continue
        variants.append((config, f"its tuned config {path.name}, entry M={m}"))
    default = vllm_default_config(problem)
    variants.append((default, "its default config (vLLM has no tuned file for this shape and "
                              "GPU)" if not variants else "its default config"))
    unique: list[tuple[dict[str, int], str]] = []
    for config, source in variants:
        if all(config != c for c, _ in unique):
            unique.append((config, source))
    return unique
