"""``scripts/flashinfer_module.sh``: FlashInfer's built fused-MoE module kept as xz chunks and put
back where FlashInfer loads AOT artifacts, byte for byte, or not at all when a chunk is damaged."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "flashinfer_module.sh"
pytestmark = pytest.mark.skipif(shutil.which("xz") is None, reason="needs the xz command")


def _run(*args: str, workspace: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, "FLASHINFER_WORKSPACE_BASE": str(workspace)})


def test_kept_module_comes_back_whole_or_not_at_all(tmp_path: Path) -> None:
    built = tmp_path / "ws/.cache/flashinfer/0.7.2.post1/90a/cached_ops/fused_moe_90"
    built.mkdir(parents=True)
    module = os.urandom(17 << 20)  # incompressible: two chunks of at most 15 MiB
    (built / "fused_moe_90.so").write_bytes(module)
    kept = tmp_path / "kept"
    assert _run("keep", str(kept), workspace=tmp_path / "ws").returncode == 0
    chunks = sorted(kept.glob("fused_moe_90.so.xz.*"))
    assert len(chunks) == 2 and all(c.stat().st_size <= 15 << 20 for c in chunks)

    site = tmp_path / "site"
    done = _run("restore", str(kept), str(site), workspace=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "flashinfer/data/aot/fused_moe_90/fused_moe_90.so").read_bytes() == module

    (site / "flashinfer/data/aot/fused_moe_90/fused_moe_90.so").unlink()
    data = bytearray(chunks[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunks[0].write_bytes(bytes(data))
    refused = _run("restore", str(kept), str(site), workspace=tmp_path)
    assert refused.returncode == 1 and "checksum differs" in refused.stdout
    assert not (site / "flashinfer/data/aot/fused_moe_90/fused_moe_90.so").exists()
