"""The vLLM pack and unpack scripts round trip: pieces in parts, split where one exceeds a part,
assembled into a site (compiled libraries and other trees in their folders), assembled again for
another pack.

No download: the pieces are small stand-ins (made by the real ``pieces`` from stand-in downloads
for ``--flashinfer``), and pip's install of the wheels is skipped."""

from __future__ import annotations

import io
import lzma
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import vllm_device_pack as pack  # noqa: E402
import vllm_device_unpack as unpack  # noqa: E402


def _sources(path: Path) -> None:
    with tarfile.open(path, "w:xz") as tar:
        for name in ("vllm/__init__.py", "vllm/vllm_flash_attn/__init__.py"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"\n"))


def _libraries(engine: bool, deepgemm: bool = False) -> dict[str, bytes]:
    names = pack.OPS + (pack.ENGINE_OPS if engine else ()) + (pack.DEEPGEMM_OPS if deepgemm
                                                               else ())
    return {name: os.urandom(3000 + 100 * i) for i, name in enumerate(names)}  # incompressible


#: A header of DeepGEMM's include tree, incompressible so that its tar is split into chunks.
HEADER = f"vllm/{pack.DEEPGEMM_INCLUDE}/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh"


def _pack(tmp: Path, out: Path, engine: bool, monkeypatch: pytest.MonkeyPatch,
          deepgemm: bool = False) -> dict:
    libraries = _libraries(engine, deepgemm)
    header = os.urandom(2500)

    def pieces(version: str, work: Path, engine: bool = False, deepgemm: bool = False,
               flashinfer: bool = False) -> list[Path]:
        (work / "deps").mkdir()
        (work / "deps" / "a-1-py3-none-any.whl").write_bytes(b"wheel")
        _sources(work / "src.tar.xz")
        made = sorted((work / "deps").iterdir()) + [work / "src.tar.xz"]
        for name, data in libraries.items():
            packed = work / f"{name}.xz"
            packed.parent.mkdir(parents=True, exist_ok=True)
            packed.write_bytes(lzma.compress(data))
            made.append(packed)
        if deepgemm:  # the real retar() on a stand-in wheel holding one header
            wheel = work / "w.zip"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(HEADER, header)
                zf.writestr("vllm/other.py", "")
            with zipfile.ZipFile(wheel) as zf:
                made.append(pack.retar(zf, work / "deep_gemm_include.tar.xz",
                                       f"vllm/{pack.DEEPGEMM_INCLUDE}/"))
            wheel.unlink()
        return made

    monkeypatch.setattr(pack, "pieces", pieces)
    argv = (["pack", "0.34.0", "--out", str(out), "--part-mb", "0.002"] + ["--engine"] * engine
            + ["--deepgemm"] * deepgemm)
    monkeypatch.setattr(sys, "argv", argv)
    pack.main()
    return {**libraries, **({HEADER.removeprefix("vllm/"): header} if deepgemm else {})}


def _unpack(part: Path, tmp: Path, monkeypatch: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    monkeypatch.setattr(sys, "argv", ["unpack", str(part), "--stage", str(tmp / "stage"),
                                      "--site", str(tmp / "site"), *extra])
    unpack.main()
    return capsys.readouterr().out


@pytest.fixture
def no_pip(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []
    monkeypatch.setattr(unpack.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    return calls


@pytest.mark.parametrize("engine", [False, True])
def test_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                    capsys: pytest.CaptureFixture[str], no_pip: list, engine: bool) -> None:
    libraries = _pack(tmp_path, tmp_path / "pack", engine, monkeypatch)
    printed = capsys.readouterr().out
    parts = sorted((tmp_path / "pack").iterdir())
    assert len(parts) > len(libraries)  # each library exceeds a part: split into chunks
    assert f"{len(parts)} parts" in printed
    for part in parts[:-1]:
        assert "waiting for" in _unpack(part, tmp_path, monkeypatch, capsys)
    done = _unpack(parts[-1], tmp_path, monkeypatch, capsys)
    assert "ready: vLLM 0.34.0" in done and ("offline engine" in done) == engine
    for name, data in libraries.items():
        assert (tmp_path / "site" / "vllm" / name).read_bytes() == data
    assert len(no_pip) == 1 and no_pip[0][-1].endswith("a-1-py3-none-any.whl")


def test_other_pack_assembles_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str], no_pip: list) -> None:
    for engine, out in ((False, "moe"), (True, "engine")):
        _pack(tmp_path, tmp_path / out, engine, monkeypatch)
        for part in sorted((tmp_path / out).iterdir()):
            _unpack(part, tmp_path, monkeypatch, capsys)
    assert len(no_pip) == 2  # the MoE-only site, then the engine's over it
    assert (tmp_path / "site" / "vllm" / pack.ENGINE_OPS[0]).exists()
    _unpack(sorted((tmp_path / "engine").iterdir())[0], tmp_path, monkeypatch, capsys)
    assert len(no_pip) == 2  # the same pack again: nothing to do


def test_deepgemm_library_and_headers_land_in_the_vendored_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_pip: list) -> None:
    """``--deepgemm``: DeepGEMM's library beside its ``.py`` files and its JIT headers under
    ``include/``, both split into chunks and joined, so ``vllm.third_party.deep_gemm`` imports."""
    files = _pack(tmp_path, tmp_path / "pack", False, monkeypatch, deepgemm=True)
    printed = capsys.readouterr().out
    assert "with DeepGEMM" in printed
    parts = sorted((tmp_path / "pack").iterdir())
    pieces = {p.name for part in parts for p in part.rglob("*") if p.is_file()}
    assert "deep_gemm_include.tar.xz.001" in pieces  # the headers' tar exceeded a part
    for part in parts:
        done = _unpack(part, tmp_path, monkeypatch, capsys)
    assert "ready: vLLM 0.34.0 (MoE path) and DeepGEMM" in done
    deep_gemm = tmp_path / "site" / "vllm" / "third_party" / "deep_gemm"
    assert (deep_gemm / "_C_extension.abi3.so").read_bytes() == files[pack.DEEPGEMM_OPS[0]]
    for name, data in files.items():
        assert (tmp_path / "site" / "vllm" / name).read_bytes() == data
    assert sorted(p.relative_to(deep_gemm / "include").as_posix()
                  for p in (deep_gemm / "include").rglob("*") if p.is_file()) == [
        "deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh"]



def test_flashinfer_comes_first_into_a_site_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_pip: list) -> None:
    """``--flashinfer`` through the real ``pieces``, with pip's downloads and vLLM's sources
    stood in: FlashInfer's wheel travels as an xz tar of its files (split here, as it exceeds a
    part) in the first parts with the wheels its build imports, and lands, as pip would install
    it, in the early site alone; ``FLASHINFER_DEPS`` go to pip."""
    asked: list[str] = []
    source = os.urandom(5000)  # incompressible: 2.5 parts
    package = {"flashinfer/__init__.py": b"", "flashinfer/data/csrc/moe.cu": source,
               "flashinfer_python-0.7.2.post1.dist-info/METADATA": b"Name: flashinfer-python\n"}

    def pip_download(dest: Path, *what: str) -> None:
        dest.mkdir(parents=True, exist_ok=True)
        for requirement in what:
            asked.append(requirement)
            name = re.split(r"[=<>~\[]", requirement)[0].replace("-", "_").lower()
            if name in ("vllm", "flashinfer_python"):
                files = package if name != "vllm" else {
                    f"vllm/{op}": os.urandom(1000) for op in pack.OPS}
                with zipfile.ZipFile(dest / f"{name}-1-py3-none-any.whl", "w") as zf:
                    for path, data in files.items():
                        zf.writestr(path, data)
            else:
                (dest / f"{name}-1-py3-none-any.whl").write_bytes(b"wheel")

    src = tmp_path / "sources"
    (src / "vllm").mkdir(parents=True)
    (src / "vllm" / "__init__.py").write_text("")
    monkeypatch.setattr(pack, "pip_download", pip_download)
    monkeypatch.setattr(pack, "sources", lambda version: src)
    monkeypatch.setattr(sys, "argv", ["pack", "0.34.0", "--out", str(tmp_path / "pack"),
                                      "--part-mb", "0.002", "--flashinfer"])
    pack.main()
    assert "with FlashInfer" in capsys.readouterr().out
    assert pack.FLASHINFER in asked and set(pack.FLASHINFER_DEPS) <= set(asked)
    parts = sorted((tmp_path / "pack").iterdir())
    pieces = {p.name for part in parts for p in part.rglob("*") if p.is_file()}
    assert "flashinfer.tar.xz.001" in pieces and not any("flashinfer_python" in p for p in pieces)
    # FlashInfer and its build's wheels come first, alone: the early site is there once
    # they are, before vLLM (the last parts) is.
    first = [{p.name for p in part.rglob("*") if p.is_file()} - {"manifest.json"}
             for part in parts]
    early = [i for i, names in enumerate(first)
             if any(n.startswith("flashinfer.tar.xz") or n.startswith(("ninja", "requests"))
                    for n in names)]
    assert early == list(range(len(early))) and len(early) < len(parts)
    assert not any(n.startswith(("vllm", "src", "a_")) for i in early for n in first[i])
    site = tmp_path / "early"
    for i, part in enumerate(parts):
        done = _unpack(part, tmp_path, monkeypatch, capsys, "--early-site", str(site))
        assert ("early: FlashInfer" in done) == (i >= early[-1])
        assert (site / "flashinfer/data/csrc/moe.cu").exists() == (i >= early[-1])
        if i == early[-1]:
            (install,) = no_pip
            assert {Path(a).name.split("-")[0] for a in install if a.endswith(".whl")} == {
                "apache_tvm_ffi", "packaging", "requests", "urllib3", "idna", "certifi",
                "nvidia_ml_py", "ninja"}
            (site / "flashinfer/data/csrc/moe.cu").touch()  # a later part must not reinstall it
            built = (site / "flashinfer/data/csrc/moe.cu").stat().st_mtime_ns
    assert (site / "flashinfer/data/csrc/moe.cu").stat().st_mtime_ns == built
    assert "ready: vLLM 0.34.0 (MoE path) (FlashInfer apart" in done
    for path, data in package.items():  # only in its own site: vLLM's alone does not see it
        assert not (tmp_path / "site" / path).exists()
        assert (site / path).read_bytes() == data
    install = no_pip[-1]
    assert len(no_pip) == 2  # the early site's wheels once, then vLLM's
    wheels = {Path(a).name.split("-")[0] for a in install if a.endswith(".whl")}
    assert {"nvidia_ml_py", "ninja"} <= wheels and "flashinfer_python" not in wheels


def test_joined_chunks_read_at_most_what_is_asked(tmp_path: Path) -> None:
    """``tarfile``'s stream reader copies whatever a read returns beyond its ask at every later
    read: a read that returned the whole decompressed tree made FlashInfer's 421 MB extraction
    quadratic. Each read gives at most ``n`` bytes, and the chunks join into the file."""
    data = os.urandom(1 << 16) * 40  # compresses well: one read's input decompresses to far more
    packed = lzma.compress(data)
    chunks = []
    for i in range(0, len(packed), 4000):
        chunks.append(tmp_path / f"t.xz.{i:06d}")
        chunks[-1].write_bytes(packed[i:i + 4000])
    got = bytearray()
    with unpack._Joined(chunks) as f:
        while block := f.read(10240):
            assert len(block) <= 10240
            got += block
    assert bytes(got) == data
