"""Load aiter's Triton MoE kernels without running ``import aiter``.

aiter's package ``__init__`` builds HIP extensions, so ``import aiter`` fails on CUDA and on CPU.
Its Triton kernels need none of that: outside ROCm we register a bare module object for ``aiter``
whose ``__path__`` is the installed folder, then import only the submodules we run. On ROCm the
real package is imported, since serving there has it loaded anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
import types
from typing import Iterator

#: Short names of the aiter modules moetune runs -> their import paths.
MODULES: dict[str, str] = {
    "moe_op": "aiter.ops.triton.moe_op",
    "silu_fused": "aiter.ops.triton.moe_op_silu_fused",
    "gelu": "aiter.ops.triton.moe_op_gelu",
    "e2e": "aiter.ops.triton.moe_op_e2e",
}


@dataclasses.dataclass(frozen=True)
class Loaded:
    """One aiter module, or the reason it could not be loaded.

    ``interpret`` records whether Triton's CPU interpreter was on at import: ``triton.jit``
    decides that when a kernel is defined, so the flag cannot change for a loaded module.
    """

    module: types.ModuleType | None
    reason: str | None
    interpret: bool


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def load(name: str) -> Loaded:
    """The aiter module called ``name`` (a key of ``MODULES``); never raises."""
    interpret = interpret_requested()
    if importlib.util.find_spec("triton") is None:
        return Loaded(None, "triton is not installed", interpret)
    reason = _ensure_package()
    if reason:
        return Loaded(None, reason, interpret)
    try:
        with _string_arch() if name == "e2e" else contextlib.nullcontext():
            module = importlib.import_module(MODULES[name])
    except Exception as e:  # noqa: BLE001 - any import failure makes the kernel ineligible
        return Loaded(None, f"importing {MODULES[name]} failed: {type(e).__name__}: {e}", interpret)
    if not _is_rocm():
        # aiter hard-codes MI300's 8 XCDs and permutes program ids across them; on NVIDIA that
        # permutation only scatters neighbouring tiles and defeats GROUP_SIZE_M's L2 reuse.
        module.get_num_xcds = _one_xcd  # type: ignore[attr-defined]
    return Loaded(module, None, interpret)


def _one_xcd() -> int:
    return 1


def _is_rocm() -> bool:
    import torch

    return bool(getattr(torch.version, "hip", None))


def _ensure_package() -> str | None:
    """Make ``aiter`` importable as a package; None on success, else why not."""
    if "aiter" in sys.modules:
        return None
    spec = importlib.util.find_spec("aiter")
    if spec is None or not spec.submodule_search_locations:
        return "amd-aiter is not installed"
    if _is_rocm():
        try:
            importlib.import_module("aiter")
        except Exception as e:  # noqa: BLE001
            return f"import aiter failed on ROCm: {type(e).__name__}: {e}"
        return None
    package = types.ModuleType("aiter", "aiter's Triton kernels, loaded by moetune without the HIP init")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["aiter"] = package
    return None


@contextlib.contextmanager
def _string_arch() -> Iterator[None]:
    """aiter's ``get_arch()`` returns an int on CUDA (90) and ``moe_op_e2e``'s imports test it
    against strings at import time; give them a string that names no AMD arch meanwhile."""
    arch_info = importlib.import_module("aiter.ops.triton.utils._triton.arch_info")
    original = arch_info.get_arch
    arch_info.get_arch = lambda: "not_amd"
    try:
        yield
    finally:
        arch_info.get_arch = original
