"""The config vLLM's fused-MoE Triton kernel runs for a call, which the CUDA rule reads so that it
is what a vLLM user gets today: vLLM's tuned config files (their names, where vLLM looks for
them) where vLLM has one for the shape and GPU, else its default heuristic.

A file is ``E={E},N={N},device_name={dev}[,dtype={d}][,block_shape=[bn,bk]].json`` mapping token
counts to Triton configs; vLLM takes the entry nearest to the call's M (``min`` by distance, so
on a tie the entry listed first). ``N`` is the intermediate size per partition, ``d`` is
``fp8_w8a8`` for every fp8 scheme (``float32`` for float32 layers), ``dev`` is vLLM's device name
with spaces as ``_``. vLLM reads ``VLLM_TUNED_CONFIG_FOLDER`` first, then its own ``configs``.
Nothing here imports vLLM: the files are found through the installed package's location.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

from moetune.runtime.platform import SKU, normalize_device_name
from moetune.runtime.problem import DType, MoEProblem, QuantScheme
from moetune.runtime.vllm.versions import installed_facts

FILE_NAME = re.compile(r"^E=(?P<E>\d+),N=(?P<N>\d+),device_name=(?P<dev>[^,]+?)"
                       r"(?:,dtype=(?P<dtype>\w+))?(?:,block_shape=\[(?P<bn>\d+),(?P<bk>\d+)\])?"
                       r"(?P<down>_down)?\.json$")


def config_file_name(num_experts: int, n: int, device_name: str, dtype: str | None,
                     block_shape: tuple[int, int] | None, down: bool = False) -> str:
    """vLLM's ``get_config_file_name``, byte for byte; ``down``: the ``_down.json`` file vLLM
    0.34 reads GEMM2's config from (``get_moe_configs(..., down_moe=True)``)."""
    name = f"E={num_experts},N={n},device_name={device_name}"
    name += f",dtype={dtype}" if dtype else ""
    name += f",block_shape=[{block_shape[0]},{block_shape[1]}]" if block_shape else ""
    return name + ("_down.json" if down else ".json")


def selectors(problem: MoEProblem) -> tuple[str | None, tuple[int, int] | None]:
    """The ``dtype`` and ``block_shape`` parts of the file name for ``problem``."""
    if problem.quant is QuantScheme.FP8_BLOCK_128X128:
        return "fp8_w8a8", (128, 128)
    if problem.quant.is_fp8:
        return "fp8_w8a8", None
    return ("float32" if problem.dtype is DType.FLOAT32 else None), None


def device_key(device_name: str) -> tuple[str, str] | None:
    """vLLM device name -> (vendor, moetune SKU name); None for other vendors."""
    words = device_name.replace("_", " ")
    upper = words.upper()
    vendor = ("nvidia" if upper.startswith("NVIDIA") else
              "amd" if upper.startswith(("AMD", "RADEON")) else None)
    return (vendor, normalize_device_name(words)) if vendor else None


def shipped_folder() -> Path | None:
    """The ``configs`` folder of the installed vLLM, or None without vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)), "model_executor", "layers",
                "fused_moe", "configs")


@functools.cache
def _shipped_names() -> dict[tuple[str, str], str]:
    """Exact device spellings from the config files the installed vLLM ships (if any)."""
    folder = shipped_folder()
    names: dict[tuple[str, str], str] = {}
    for f in sorted(folder.glob("E=*.json")) if folder else ():
        m = FILE_NAME.match(f.name)
        key = m and device_key(m["dev"])
        if key:
            names.setdefault(key, m["dev"])
    return names


def vllm_device_name(vendor: str, name: str) -> tuple[str, bool]:
    """vLLM's device name for a SKU, and whether it was guessed (not seen in vLLM's files)."""
    known = _shipped_names().get((vendor, name))
    guessed = known is None
    dev = known or (f"NVIDIA_{name}" if vendor == "nvidia" else f"AMD_Instinct_{name}")
    if "H200" in dev.split("_"):  # vLLM maps the whole H200 family to one name
        dev, guessed = "NVIDIA_H200", False
    return dev, guessed


def config_folders() -> tuple[Path, ...]:
    """Where vLLM looks for tuned files, in its order: ``VLLM_TUNED_CONFIG_FOLDER``, then the
    ``configs`` folder of the installed vLLM (those that exist)."""
    user = os.environ.get("VLLM_TUNED_CONFIG_FOLDER")
    folders = (Path(user) if user else None, shipped_folder())
    return tuple(f for f in folders if f is not None and f.is_dir())


def tuned_file(problem: MoEProblem, sku: SKU, folders: tuple[Path, ...] | None = None,
               down: bool = False) -> Path | None:
    """The tuned config file vLLM would read for ``problem`` on ``sku`` from ``folders``
    (default: where vLLM looks), if one exists (``down``: its GEMM2 file)."""
    name = config_file_name(problem.num_experts, problem.intermediate_size,
                            vllm_device_name(sku.vendor.value, sku.name)[0], *selectors(problem),
                            down=down)
    for folder in config_folders() if folders is None else folders:
        if (folder / name).is_file():
            return folder / name
    return None


def configs_label(problem: MoEProblem, sku: SKU) -> str:
    """Which of vLLM's config sources its Triton path reads for ``problem`` on ``sku``: the
    tuned file's name (and GEMM2's ``_down.json`` where the installed vLLM reads one), or
    ``default`` (its heuristic). A baseline records it: the same vLLM with another tuned file
    is another baseline."""
    found = tuned_file(problem, sku)
    if found is None:
        return "default"
    reads_down = (installed_facts().down_configs
                  and problem.quant is QuantScheme.FP8_BLOCK_128X128)
    down = tuned_file(problem, sku, down=True) if reads_down else None
    return found.name if down is None else f"{found.name} + {down.name}"


@functools.lru_cache(maxsize=64)
def _entries(path: Path) -> dict[int, dict[str, Any]] | None:
    """``{token count: config}`` of a file, in file order; None if it is not readable JSON."""
    try:
        data = json.loads(path.read_text())
        return {int(k): v for k, v in data.items() if k != "triton_version"}
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def tuned_config(problem: MoEProblem, sku: SKU, folders: tuple[Path, ...] | None = None,
                 down: bool = False) -> tuple[dict[str, Any], Path, int] | None:
    """(config, file, entry M) vLLM runs for ``problem`` from a tuned file in ``folders``
    (default: where vLLM looks), or None when vLLM would use its default heuristic (no file,
    or one it could not read either). ``down``: GEMM2's entry from the ``_down.json`` file,
    which vLLM 0.34 takes (``USE_TMA`` and all) where it runs its sorted-A TMA path."""
    path = tuned_file(problem, sku, folders, down)
    entries = _entries(path) if path else None
    if not entries:
        return None
    m = min(entries, key=lambda k: abs(k - problem.num_tokens))
    return dict(entries[m]), path, m  # type: ignore[arg-type]


def vllm_default_config(problem: MoEProblem) -> dict[str, int]:
    """vLLM's ``get_default_config`` on CUDA (fused_moe.py, PR #34846 and the block-fp8 decode
    tiles after it), for M = num_tokens. The tuned-table baseline every CUDA winner is measured
    against. Per-channel fp8 is ``fp8_w8a8`` without a block shape: the general branch."""
    m, e = problem.num_tokens, problem.num_experts
    if problem.quant is QuantScheme.FP8_BLOCK_128X128:
        block_n, block_k = 128, 128  # the block shape vLLM reads fp8 block files for
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


def tuned_entries(problem: MoEProblem, sku: SKU) -> list[tuple[dict[str, Any], Path, int]]:
    """The tuned entry vLLM may run for ``problem`` on ``sku`` from each folder it looks in
    (``VLLM_TUNED_CONFIG_FOLDER``, then its shipped ``configs``), in that order: (config, file,
    entry M). Empty where vLLM would use its default heuristic everywhere."""
    found = []
    for folder in config_folders():
        tuned = tuned_config(problem, sku, (folder,))
        if tuned is not None:
            found.append(tuned)
    return found
