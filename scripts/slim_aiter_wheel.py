"""Drop aiter's ROCm payload (``aiter_meta/``: HIP sources and compiled code objects, 174 MB
unpacked) from the amd-aiter wheel in a wheel folder, for the CUDA machine: moetune loads only
aiter's Triton kernels there (``runtime/aiter_loader.py``), and the working tree that travels to
that machine is capped at 64 MiB.

    python scripts/slim_aiter_wheel.py .whl
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

ROCM_ONLY = "aiter_meta/"


def slim(folder: Path) -> None:
    for wheel in folder.glob("amd_aiter-*.whl"):
        tmp = wheel.with_suffix(".slim")
        with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
            for item in zin.infolist():
                if item.filename.startswith(ROCM_ONLY):
                    continue
                data = zin.read(item.filename)
                if item.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(line for line in data.splitlines(True)
                                    if not line.startswith(ROCM_ONLY.encode()))
                zout.writestr(item, data)
        os.replace(tmp, wheel)
        print(f"{wheel}: {wheel.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    slim(Path(sys.argv[1]))
