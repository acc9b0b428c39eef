"""Pack what running a vLLM release's MoE path (or, with ``--engine``, its offline engine) on a
machine without its wheel needs, in parts that each fit one transfer, for
``scripts/vllm_device_unpack.py`` to assemble there.

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

``--engine`` adds what ``vllm.LLM`` (the offline engine, with Triton attention) imports beyond
that on CUDA (bench/results/vllm-engine-closure-2026-12-07): the wheels ``ENGINE_DEPS`` (16 MB)
and ``vllm_flash_attn/_vllm_fa3_C.abi3.so.xz`` (``ENGINE_OPS``), because
``vllm.model_executor.layers.attention`` imports ``vllm.vllm_flash_attn``, which raises
ImportError on CUDA unless one of its compiled libraries loads, whichever attention backend runs.

``--deepgemm`` adds vLLM's vendored DeepGEMM (``vllm/third_party/deep_gemm``; its ``.py`` files are
in the sources already): ``third_party/deep_gemm/_C_extension.abi3.so.xz`` (``DEEPGEMM_OPS``, 30 MB,
5 MB compressed; built on torch's stable ABI, linking libcudart.so.13 as the GPU image's torch
does) and ``deep_gemm_include.tar.xz``, the CUTLASS/CuTe and DeepGEMM headers its JIT compiles
kernels against with nvcc (``DEEPGEMM_INCLUDE``, 29 MB, 1 MB compressed). Then ``import
vllm.third_party.deep_gemm`` works there, and vLLM finds it (``has_deep_gemm``).

``--flashinfer`` adds FlashInfer (``FLASHINFER``) and the two small wheels its import needs
beyond ``DEPS`` (``FLASHINFER_DEPS``): none of its other requirements (the CUTLASS DSL, NCCL,
cuDNN's frontend, cuda-python, ...) is imported on the way to
``flashinfer.fused_moe.cutlass_fused_moe`` (bench/results/flashinfer-closure-2026-12-07). Its
wheel is pure Python plus the CUDA sources its JIT compiles (421 MB), deflated file by file into
62 MB; ``flashinfer.tar.xz`` holds the same files in 16 MB, and extracting it into a folder is
what installing the wheel does (it has no ``.data``; only its ``flashinfer`` command is left out).
Its build takes tens of minutes on Hopper, so FlashInfer and the wheels its build imports
(``FLASHINFER_EARLY``) make up the first parts on their own (listed as ``early`` in the
manifest): ``vllm_device_unpack.py --early-site`` installs them, in a folder apart from vLLM's
site, as soon as they are there.

Each part folder holds its pieces and ``manifest.json`` (every piece of every part with its
SHA-256), so the unpacker knows when it has all of them.

    python scripts/vllm_device_pack.py 0.34.0 --out .vllm-pack --part-mb 46 [--engine] [--deepgemm]
        [--flashinfer]
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
#: What vLLM 0.34's offline engine imports beyond ``DEPS`` and the image: ``vllm.entrypoints.llm``
#: imports FastAPI (its pooling mixin) and the OpenAI and harmony chat types at module level;
#: anyio and typing-extensions at the versions those need (the image's are not known to be).
ENGINE_DEPS = (
    "anyio>=4.10.0,<5", "fastapi>=0.133.0,<0.137.0", "jiter>=0.16.0,<1", "openai>=2.25.0",
    "oss-harmony>=0.0.11", "sniffio", "starlette>=1.0.1", "typing-extensions>=4.16.0",
    # Imported inside functions on the engine's start, so the import closure missed them: the
    # CLI-argument parser behind ``LLM``'s log line (partial-json-parser), the model loader's
    # online-quantization check (compressed-tensors with loguru). The rest of vLLM's pure
    # requirements came with them in the run that started the engine on an H100
    # (bench/results/vllm-e2e-h100-2026-12-07); flashinfer, the CUTLASS DSL and numba did not.
    "partial-json-parser", "compressed-tensors==0.17.0", "loguru", "depyf==0.20.0", "astor",
    "dill", "blake3", "protobuf", "sentencepiece", "tiktoken", "lm-format-enforcer==0.11.3",
    "outlines_core==0.2.14", "lark==1.2.2", "interegular", "diskcache", "frozendict",
    "jsonschema", "referencing", "rpds-py", "jsonschema-specifications", "orjson",
    "prometheus-fastapi-instrumentator", "pyyaml", "six", "watchfiles", "python-json-logger",
    "ijson", "setproctitle", "psutil",
)
#: Flash-attention's Hopper library: only for ``vllm.vllm_flash_attn`` to import (its
#: ``__init__`` raises without FA2 or FA3); Triton attention runs none of it. FA3 rather than
#: FA2: 25 MB compressed against 65, and both import only stable-ABI libtorch symbols.
ENGINE_OPS = ("vllm_flash_attn/_vllm_fa3_C.abi3.so",)
#: vLLM's vendored DeepGEMM: its library (registers ``torch.ops.deep_gemm``), and the headers its
#: JIT needs at first use of each kernel (``deep_gemm._C.init`` is given the package folder).
DEEPGEMM_OPS = ("third_party/deep_gemm/_C_extension.abi3.so",)
DEEPGEMM_INCLUDE = "third_party/deep_gemm/include"
#: FlashInfer's CUTLASS fused MoE, carried as its wheel's files in an xz tar, and the wheels that
#: ``import flashinfer`` needs beyond ``DEPS`` (which hold apache-tvm-ffi, packaging and requests)
#: and the image: pynvml (nvidia-ml-py, imported by ``flashinfer.utils``) and ninja, which its JIT
#: runs from ``PATH``.
FLASHINFER = "flashinfer-python==0.7.2.post1"
FLASHINFER_DEPS = ("nvidia-ml-py", "ninja")
#: The distributions (wheel-file spelling) that FlashInfer's import and JIT build need beside the
#: image: their wheels and ``flashinfer.tar.xz`` are packed into the first parts, alone, so that
#: its build (tens of minutes) can start at the first call, before the rest of vLLM arrives.
FLASHINFER_EARLY = ("apache_tvm_ffi", "packaging", "requests", "urllib3", "idna", "certifi",
                    "nvidia_ml_py", "ninja")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64")


def pip_download(dest: Path, *what: str) -> None:
    flags = [f for p in PLATFORMS for f in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                    *flags, "-d", str(dest), *what], check=True)


def pieces(version: str, work: Path, engine: bool = False, deepgemm: bool = False,
           flashinfer: bool = False) -> list[Path]:
    """Every file to carry, built in ``work``; ``engine`` adds what the offline engine needs,
    ``deepgemm`` vLLM's vendored DeepGEMM, ``flashinfer`` FlashInfer."""
    deps = work / "deps"
    deps.mkdir()
    pip_download(deps, *DEPS, *(ENGINE_DEPS if engine else ()),
                 *(FLASHINFER_DEPS if flashinfer else ()))
    src = work / "src.tar.xz"
    with tarfile.open(src, "w:xz", preset=9) as tar:
        tar.add(sources(version), arcname=".",
                filter=lambda t: None if "__pycache__" in t.name else t)
    wheel_dir = work / "wheel"
    pip_download(wheel_dir, f"vllm=={version}")
    (wheel,) = wheel_dir.glob("vllm-*.whl")
    out = sorted(deps.iterdir()) + [src]
    with zipfile.ZipFile(wheel) as zf:
        for name in OPS + (ENGINE_OPS if engine else ()) + (DEEPGEMM_OPS if deepgemm else ()):
            packed = work / f"{name}.xz"
            packed.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(f"vllm/{name}") as raw, lzma.open(packed, "wb", preset=9) as xz:
                shutil.copyfileobj(raw, xz, 1 << 24)
            out.append(packed)
        if deepgemm:
            out.append(retar(zf, work / "deep_gemm_include.tar.xz", f"vllm/{DEEPGEMM_INCLUDE}/"))
    shutil.rmtree(wheel_dir)
    if flashinfer:
        pip_download(wheel_dir, FLASHINFER)
        (wheel,) = wheel_dir.glob("flashinfer_python-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            out.append(retar(zf, work / "flashinfer.tar.xz"))
        shutil.rmtree(wheel_dir)
    return out


def retar(zf: zipfile.ZipFile, dest: Path, prefix: str = "") -> Path:
    """The wheel's files under ``prefix`` as an xz tar of their paths in the wheel, which are
    their paths in the site (the unpacker extracts it there)."""
    with tarfile.open(dest, "w:xz", preset=9) as tar:
        for info in zf.infolist():
            if info.filename.startswith(prefix) and not info.is_dir():
                entry = tarfile.TarInfo(info.filename)
                entry.size = info.file_size
                with zf.open(info) as data:
                    tar.addfile(entry, data)
    return dest


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


def is_early(piece: Path) -> bool:
    """Whether ``piece`` is one of what FlashInfer's build needs (``FLASHINFER_EARLY``)."""
    if piece.name.startswith("flashinfer.tar.xz"):
        return True
    return piece.parent.name == "deps" and piece.name.split("-")[0] in FLASHINFER_EARLY


def fill(files: list[Path], limit: int) -> list[list[Path]]:
    """``files`` in parts of at most ``limit`` bytes: first fit, largest first."""
    parts: list[list[Path]] = []
    for f in sorted(files, key=lambda p: -p.stat().st_size):
        size = f.stat().st_size
        home = next((p for p in parts if sum(x.stat().st_size for x in p) + size <= limit), None)
        if home is None:
            parts.append(home := [])
        home.append(f)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version")
    parser.add_argument("--out", type=Path, default=Path(".vllm-pack"))
    parser.add_argument("--part-mb", type=float, default=46.0)
    parser.add_argument("--engine", action="store_true",
                        help="also what vllm.LLM needs on CUDA (ENGINE_DEPS, ENGINE_OPS)")
    parser.add_argument("--deepgemm", action="store_true",
                        help="also vLLM's vendored DeepGEMM (DEEPGEMM_OPS, DEEPGEMM_INCLUDE)")
    parser.add_argument("--flashinfer", action="store_true",
                        help="also FlashInfer's CUTLASS fused MoE (FLASHINFER, "
                        "FLASHINFER_DEPS)")
    args = parser.parse_args()
    limit = int(args.part_mb * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        files = [c for p in pieces(args.version, work, args.engine, args.deepgemm,
                                   args.flashinfer)
                 for c in split(p, limit)]
        early = [f for f in files if is_early(f.relative_to(work))] if args.flashinfer else []
        parts = fill(early, limit)
        parts += fill([f for f in files if f not in early], limit)
        manifest = {"version": args.version, "engine": args.engine,
                    "deepgemm": args.deepgemm, "flashinfer": args.flashinfer,
                    "parts": len(parts),
                    "pieces": {str(f.relative_to(work)): sha256(f) for f in files},
                    "early": [str(f.relative_to(work)) for f in early]}
        shutil.rmtree(args.out, ignore_errors=True)
        total = 0
        for i, part in enumerate(parts, 1):
            folder = args.out / f"p{i}"
            for f in part:
                (folder / f.relative_to(work)).parent.mkdir(parents=True, exist_ok=True)
                shutil.move(f, folder / f.relative_to(work))
            (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            total += size
            print(f"{folder}: {size / 1e6:.1f} MB")
        print(f"{len(parts)} parts, {total / 1e6:.1f} MB in all ({len(files)} pieces"
              f"{', with the engine' if args.engine else ''}"
              f"{', with DeepGEMM' if args.deepgemm else ''}"
              f"{', with FlashInfer' if args.flashinfer else ''})")


if __name__ == "__main__":
    main()
