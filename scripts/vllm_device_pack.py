"""Pack what running a vLLM release's MoE path on a machine without its wheel needs, in parts
that each fit one transfer, for ``scripts/vllm_device_unpack.py`` to assemble there.

The GPU machine has torch, Triton and CUDA but no package index, and cannot install vLLM's CUDA
wheel (it pins another torch, and is 240-340 MB). vLLM's compiled ops are built against torch's
stable ABI, so they load under another torch; its Python sources import once their pure-Python
and small compiled dependencies are there (``DEPS``: what ``import
vllm.model_executor.layers.fused_moe`` needs beyond the GPU image, found by importing it in an
environment like the image's, bench/results/vllm-import-closure-2026-12-07). The parts hold:

* ``deps/``: those dependencies' CPython 3.12 manylinux wheels (44 MB);
* ``src.tar.xz``: the release's ``.py`` files, tuned configs and dist-info (8 MB);
* ``_C_stable_libtorch.abi3.so.xz`` and ``_moe_C_stable_libtorch.abi3.so.xz``: the compiled
  ops (59 and 26 MB), split into chunks where one exceeds a part.

Each part folder holds its pieces and ``manifest.json`` (every piece of every part with its
SHA-256), so the unpacker knows when it has all of them.

    python scripts/vllm_device_pack.py 0.34.0 --out .vllm-pack --part-mb 46
    # -> .vllm-pack/p1 .. pN: carry one per call, then run vllm_device_unpack.py on it
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vllm_device_unpack import sha256  # noqa: E402
from vllm_sources import sources  # noqa: E402

#: vLLM 0.34's import closure beyond the GPU image (torch, triton, numpy, rich, typer, ...).
DEPS = (
    "aiohappyeyeballs", "aiohttp>=3.14.4", "aiosignal", "annotated-doc", "annotated-types",
    "apache-tvm-ffi==0.1.11", "attrs", "cachetools", "cbor2", "certifi>=2026.10.19",
    "cloudpickle", "frozenlist", "h11", "httpcore2", "httpx2", "huggingface_hub>=2.0.0", "idna",
    "llguidance>=1.7.0,<1.8.0", "msgspec", "multidict>=6.9.1", "packaging", "pillow>=13.0.0",
    "prometheus_client>=0.18.0", "propcache", "py-cpuinfo", "pybase64", "pydantic>=2.12.0",
    "pydantic_core", "pyzmq>=25.0.0", "regex", "requests>=2.33.0", "safetensors>=0.8.0",
    "tokenizers>=0.23.3", "transformers>=5.16.1,<5.23.0", "truststore", "typing-inspection",
    "urllib3", "uvloop", "xgrammar==0.2.8", "yarl",
)
OPS = ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64")


def pip_download(dest: Path, *what: str) -> None:
    flags = [f for p in PLATFORMS for f in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                    *flags, "-d", str(dest), *what], check=True)


def pieces(version: str, work: Path) -> list[Path]:
    """Every file to carry, built in ``work``."""
    deps = work / "deps"
    deps.mkdir()
    pip_download(deps, *DEPS)
    src = work / "src.tar.xz"
    with tarfile.open(src, "w:xz", preset=9) as tar:
        tar.add(sources(version), arcname=".",
                filter=lambda t: None if "__pycache__" in t.name else t)
    wheel_dir = work / "wheel"
    pip_download(wheel_dir, f"vllm=={version}")
    (wheel,) = wheel_dir.glob("vllm-*.whl")
    out = sorted(deps.iterdir()) + [src]
    with zipfile.ZipFile(wheel) as zf:
        for name in OPS:
            packed = work / f"{name}.xz"
            with zf.open(f"vllm/{name}") as raw, lzma.open(packed, "wb", preset=9) as xz:
                shutil.copyfileobj(raw, xz, 1 << 24)
            out.append(packed)
    shutil.rmtree(wheel_dir)
    return out


def split(path: Path, limit: int) -> list[Path]:
    """``path`` as chunks of at most ``limit`` bytes (``name.000``, ...), or itself."""
    if path.stat().st_size <= limit:
        return [path]
    chunks = []
    with path.open("rb") as f:
        while data := f.read(limit):
            chunk = path.with_name(f"{path.name}.{len(chunks):03d}")
            chunk.write_bytes(data)
            chunks.append(chunk)
    path.unlink()
    return chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version")
    parser.add_argument("--out", type=Path, default=Path(".vllm-pack"))
    parser.add_argument("--part-mb", type=float, default=46.0)
    args = parser.parse_args()
    limit = int(args.part_mb * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        files = [c for p in pieces(args.version, work) for c in split(p, limit)]
        parts: list[list[Path]] = []
        for f in sorted(files, key=lambda p: -p.stat().st_size):  # first fit, largest first
            size = f.stat().st_size
            home = next((p for p in parts if sum(x.stat().st_size for x in p) + size <= limit),
                        None)
            if home is None:
                parts.append(home := [])
            home.append(f)
        manifest = {"version": args.version, "parts": len(parts),
                    "pieces": {str(f.relative_to(work)): sha256(f) for f in files}}
        shutil.rmtree(args.out, ignore_errors=True)
        for i, part in enumerate(parts, 1):
            folder = args.out / f"p{i}"
            for f in part:
                (folder / f.relative_to(work)).parent.mkdir(parents=True, exist_ok=True)
                shutil.move(f, folder / f.relative_to(work))
            (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
            print(f"{folder}: {sum(f.stat().st_size for f in folder.rglob('*')) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
