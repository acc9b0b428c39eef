"""The Triton fused-MoE config space (vLLM's tuning grid), its shared-memory constraint, and
which of vLLM's configs (``runtime/vllm/configs.py``, where vLLM's files are read) run here."""

from __future__ import annotations

import functools
from typing import Any

from moetune.runtime.kernels.base import Param, invalid_params
from moetune.runtime.platform import SKU
from moetune.runtime.problem import DType, MoEProblem, QuantScheme
from moetune.runtime.vllm.configs import tuned_entries, vllm_default_config

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


#: Moves the local search makes together (``Param.moves_with``): a taller or wider tile with one
#: step more warps (or fewer, shrinking), a deeper K step with one pipeline stage less. At
#: DeepSeek-V3's 2048-4096 tokens every measured climb stayed at vLLM's 64x64 GEMM1 tiles and 4
#: warps, where a 128-row tile alone was slower. On the H200 the coupled moves then found no
#: faster tiles there either (bench/results/scales-h200-2026-12-03): they make the climb's
#: answer "no neighbour gains" hold for these pairs, at about four evaluations per GEMM a step.
MOVES_WITH: dict[str, tuple[tuple[str, int], ...]] = {
    "BLOCK_SIZE_M": (("num_warps", 1),),
    "BLOCK_SIZE_N": (("num_warps", 1),),
    "BLOCK_SIZE_K": (("num_stages", -1),),
}


def config_params(prefix: str = "", space: dict[str, tuple[int, ...]] = SPACE,
                  extra: dict[str, tuple[int, ...]] = VLLM_FILE_EXTRA) -> tuple[Param, ...]:
    """``space`` as kernel parameters, names prefixed (``g1_``) when a kernel holds several."""
    return tuple(Param(prefix + name, choices, extra.get(name, ()),
                       moves_with=tuple((prefix + other, way)
                                        for other, way in MOVES_WITH.get(name, ())
                                        if other in space))
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


#: SMs a persistent grid assumes under Triton's CPU interpreter: few, so that each program walks
#: several tiles, as on a GPU.
INTERPRETER_UNITS = 2


@functools.cache
def compute_units(device: Any) -> int:
    """The SMs (CUs) of ``device``, which a persistent grid fills with programs."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_UNITS


@functools.cache
def tma_reason() -> str | None:
    """Why the current device cannot load tiles through TMA descriptors, or None: Hopper and
    newer NVIDIA GPUs, and Triton's CPU interpreter, which emulates them. Triton lowers
    descriptors to plain loads on ROCm, so a TMA variant would only repeat the pointer one."""
    import torch

    if not torch.cuda.is_available():
        return None
    if torch.version.hip:
        return "no TMA unit on ROCm (Triton lowers descriptors to plain loads there)"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"TMA needs sm_90 or newer, device is sm_{major}{minor}"
    return None


@functools.cache
def pdl_reason() -> str | None:
    """Why the current device cannot run a launch that overlaps the one before it (Hopper's
    programmatic dependent launch, with its PTX waits), or None: NVIDIA sm_90 and newer only;
    Triton's CPU interpreter runs no PTX."""
    import torch

    if not torch.cuda.is_available() or torch.version.hip:
        return "programmatic dependent launch needs an NVIDIA GPU (sm_90 or newer)"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"programmatic dependent launch needs sm_90 or newer, device is sm_{major}{minor}"
    return None


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


def vllm_config(problem: MoEProblem, sku: SKU) -> tuple[dict[str, int], str]:
    """The config vLLM runs for ``problem`` on ``sku`` (``try_get_optimal_moe_config``: its
    tuned file's nearest entry, else ``get_default_config``), and where it came from."""
    return vllm_config_variants(problem, sku)[0]


def vllm_config_variants(problem: MoEProblem, sku: SKU) -> list[tuple[dict[str, int], str]]:
    """Every config vLLM may run for ``problem`` on ``sku``, depending on what the user has:
    the tuned entry of each folder vLLM looks in (``VLLM_TUNED_CONFIG_FOLDER``, its shipped
    ``configs``), then its default config. The first is what vLLM runs here; duplicates are
    dropped, so a table tuned with one setup can be trusted under the others. An entry outside
    ``config_params`` cannot run here: the default stands in for it where it comes first."""
    variants: list[tuple[dict[str, int], str]] = []
    for config, path, m in tuned_entries(problem, sku):
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
