"""Fetch a vLLM release's Python sources for the contract suite, once, into a cache.

Each supported release's wheel (240-340 MB) is downloaded without its dependencies, and only
what the contract tests import is kept (``*.py``, the tuned MoE configs and the dist-info,
about 20 MB); the wheel is deleted. Prints the folder to put first on ``PYTHONPATH``.

    python scripts/vllm_sources.py 0.34.0
    python scripts/vllm_sources.py --others   # the supported releases not installed here
    # cache: $MOETUNE_VLLM_SOURCES, default ~/.cache/moetune/vllm-sources
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

KEEP = (".py", ".json")


def sources(version: str) -> Path:
    """The folder holding ``version``'s sources, fetched on the first call."""
    cache = Path(os.environ.get("MOETUNE_VLLM_SOURCES")
                 or Path.home() / ".cache" / "moetune" / "vllm-sources")
    folder = cache / version
    if (folder / ".complete").exists():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--platform",
                        "manylinux_2_28_x86_64", "-d", tmp, f"vllm=={version}"], check=True)
        (wheel,) = Path(tmp).glob("vllm-*.whl")
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.endswith(KEEP) or ".dist-info/" in name:
                    zf.extract(name, partial)
    shutil.rmtree(folder, ignore_errors=True)  # an interrupted earlier fetch
    partial.replace(folder)
    (folder / ".complete").touch()
    return folder


def other_releases() -> list[str]:
    """The supported releases (x.y.0) other than the installed vLLM's."""
    from moetune.runtime.vllm.versions import FACTS, facts_of, installed

    here = facts_of(installed())
    return [f"{a}.{b}.0" for a, b in FACTS if here is None or (a, b) != here.version]


if __name__ == "__main__":
    print(" ".join(other_releases()) if sys.argv[1] == "--others" else sources(sys.argv[1]))
