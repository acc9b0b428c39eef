"""Assemble vLLM from the parts ``scripts/vllm_device_pack.py`` made, one part per call.

Each call moves the part it was given into ``--stage`` (kept while the machine is); once every
piece named in the manifest is there with its SHA-256, it installs the dependency wheels and
the sources into ``--site``, rebuilds the compiled ops beside them (``vllm/<path>`` for a piece
``<path>.xz``), extracts the other trees there (DeepGEMM's headers, FlashInfer), and prints
``ready``. Then ``PYTHONPATH=<site>`` imports that vLLM (and FlashInfer, whose JIT runs ninja:
``<site>/bin`` goes on ``PATH`` where the machine has none). A site
assembled from another pack (the MoE path only, then ``--engine``) is assembled again. With
``--early-site``, FlashInfer and the wheels its build imports (the pack's first parts) go into that
folder as soon as they are staged, so its JIT build can start while the other parts travel; such
a pack's FlashInfer is never put into ``--site``, so vLLM run from that site alone picks its
kernels as it does without FlashInfer, and only what puts the early site on its path sees it.
Uses only the standard library and pip.

    python3 scripts/vllm_device_unpack.py .vllm-pack/p1 --stage /tmp/vllm-stage --site /tmp/vllm-site
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def assemble(stage: Path, site: Path, manifest: dict) -> None:
    wheels = sorted(str(stage / p) for p in manifest["pieces"] if p.startswith("deps/"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--upgrade", "--target", str(site), *wheels], check=True)
    with tarfile.open(stage / "src.tar.xz") as tar:
        tar.extractall(site, filter="tar")
    # Other trees (DeepGEMM's headers, FlashInfer), their paths from the site, in chunks where
    # they were split; not the early ones (FlashInfer), which live in their own site only.
    early = {p.split(".tar.xz")[0] for p in manifest.get("early", []) if ".tar.xz" in p}
    for tree in sorted({p.split(".tar.xz")[0] for p in manifest["pieces"] if ".tar.xz" in p}
                       - {"src"} - early):
        chunks = [stage / p for p in sorted(manifest["pieces"]) if p.split(".tar.xz")[0] == tree]
        with _Joined(chunks) as f, tarfile.open(fileobj=f, mode="r|") as tar:
            tar.extractall(site, filter="tar")
    for packed in sorted({p.split(".xz")[0] for p in manifest["pieces"] if ".so.xz" in p}):
        chunks = [stage / p for p in sorted(manifest["pieces"]) if p.split(".xz")[0] == packed]
        (site / "vllm" / packed).parent.mkdir(parents=True, exist_ok=True)
        with (site / "vllm" / packed).open("wb") as out, _Joined(chunks) as f:
            shutil.copyfileobj(f, out, 1 << 24)


class _Joined:
    """The concatenation of the chunks of one xz file, decompressed, as one readable file."""

    def __init__(self, chunks: list[Path]) -> None:
        self._files = [c.open("rb") for c in chunks]
        self._lzma = lzma.LZMADecompressor()
        self._i = 0

    def read(self, n: int = -1) -> bytes:
        """At most ``n`` bytes: ``tarfile``'s stream reader keeps what it did not ask for and
        copies it again at every read, so returning more makes a large tree's extraction
        quadratic (421 MB of FlashInfer did not extract in 5 minutes)."""
        while not self._lzma.eof:
            data = b""
            if self._lzma.needs_input:
                data = self._input()
                if not data:
                    return b""
            out = self._lzma.decompress(data, n)
            if out:
                return out
        return b""

    def _input(self) -> bytes:
        while self._i < len(self._files):
            data = self._files[self._i].read(1 << 20)
            if data:
                return data
            self._i += 1
        return b""

    def __enter__(self) -> "_Joined":
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._files:
            f.close()


def install_early(stage: Path, site: Path, early: list[str]) -> None:
    """FlashInfer and the wheels its build imports (the pack's ``early`` pieces) into ``site``,
    a folder of their own: FlashInfer's JIT build can start there before vLLM is assembled, and
    reinstalling nothing under it later keeps its sources' times, which ninja compares."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--upgrade", "--target", str(site),
                    *sorted(str(stage / p) for p in early if p.endswith(".whl"))], check=True)
    chunks = [stage / p for p in sorted(early) if ".tar.xz" in p]
    with _Joined(chunks) as f, tarfile.open(fileobj=f, mode="r|") as tar:
        tar.extractall(site, filter="tar")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", type=Path)
    parser.add_argument("--stage", type=Path, default=Path("/tmp/vllm-stage"))
    parser.add_argument("--site", type=Path, default=Path("/tmp/vllm-site"))
    parser.add_argument("--early-site", type=Path,
                        help="install the pack's early pieces (FlashInfer) here once they are in")
    args = parser.parse_args()
    manifest = json.loads((args.part / "manifest.json").read_text())
    for name in manifest["pieces"]:
        if (args.part / name).exists():
            (args.stage / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(args.part / name, args.stage / name)
    missing = [n for n, digest in manifest["pieces"].items()
               if not (args.stage / n).exists() or sha256(args.stage / n) != digest]
    early = manifest.get("early", [])
    if args.early_site and early and not set(early) & set(missing):
        marker = args.early_site / ".ready"
        digest = hashlib.sha256(json.dumps(early).encode()).hexdigest()
        if not marker.exists() or marker.read_text() != digest:
            install_early(args.stage, args.early_site, early)
            marker.write_text(digest)
        print(f"early: FlashInfer in {args.early_site}")
    if missing:
        print(f"waiting for {len(missing)} of {len(manifest['pieces'])} pieces "
              f"({', '.join(sorted(missing)[:4])}...)")
        return
    ready = args.site / ".ready"  # holds the digest of the pack it was assembled from
    digest = hashlib.sha256(json.dumps(manifest["pieces"], sort_keys=True).encode()).hexdigest()
    if not ready.exists() or ready.read_text() != digest:
        assemble(args.stage, args.site, manifest)
        ready.write_text(digest)
    what = "with its offline engine" if manifest.get("engine") else "(MoE path)"
    if manifest.get("deepgemm"):
        what += " and DeepGEMM"
    if manifest.get("early"):
        what += " (FlashInfer apart, in the --early-site folder)"
    elif manifest.get("flashinfer"):
        what += f" and FlashInfer (PATH={args.site / 'bin'}:$PATH for its JIT's ninja)"
    print(f"ready: vLLM {manifest['version']} {what} in {args.site}")


if __name__ == "__main__":
    main()
