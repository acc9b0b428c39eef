"""``scripts/flashinfer_handoff.sh``: a ninja build begun on one machine, shared with and finished on
another whose paths differ. A small project laid out as FlashInfer's fused-MoE build stands for
it: the objects ninja finished travel and are not built again, an object ninja never logged (one
still being written) is built there, objects compiled there come back and count as done, and the
linked module lands where FlashInfer loads AOT artifacts."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "flashinfer_handoff.sh"
pytestmark = pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in ("ninja", "c++", "xz")),
    reason="needs ninja, a C++ compiler and xz")


def _project(root: Path) -> tuple[Path, dict[str, Path]]:
    """FlashInfer's layout in miniature: a source in its site, one generated, headers in its site
    and in CUDA_HOME, and ninja's file naming them all by absolute path."""
    here = {name: root / f"{name}_here" for name in ("site", "cuda", "tvm")}
    (here["site"] / "flashinfer/data/include").mkdir(parents=True)
    (here["site"] / "flashinfer/__init__.py").write_text("")
    (here["site"] / "flashinfer/data/include/forty.h").write_text("#define FORTY 40\n")
    (here["site"] / "flashinfer/data/a.cpp").write_text(
        '#include "forty.h"\nint from_here() { return FORTY; }\n')
    (here["cuda"] / "include").mkdir(parents=True)
    (here["cuda"] / "include/two.h").write_text("#define TWO 2\n")
    (here["tvm"] / "tvm_ffi").mkdir(parents=True)
    (here["tvm"] / "tvm_ffi/__init__.py").write_text("")
    version = root / "ws/.cache/flashinfer/0.0.0/90a"
    built = version / "cached_ops/fused_moe_90"
    (version / "generated").mkdir(parents=True)
    (version / "generated/b.cpp").write_text(
        '#include "two.h"\nint from_here();\nint zero();\n'
        'extern "C" int answer() { return from_here() + TWO + zero(); }\n')
    (version / "generated/c.cpp").write_text("int zero() { return 0; }\n")
    built.mkdir(parents=True)
    flags = f"-fPIC -I{here['site']}/flashinfer/data/include -I{here['cuda']}/include"
    (built / "build.ninja").write_text(
        f"rule compile\n  command = c++ {flags} -c $in -o $out\n"
        "rule link\n  command = c++ $in -shared -o $out\n"
        f"build {built}/a.o: compile {here['site']}/flashinfer/data/a.cpp\n"
        f"build {built}/b.o: compile {version}/generated/b.cpp\n"
        f"build {built}/c.o: compile {version}/generated/c.cpp\n"
        f"build {built}/fused_moe_90.so: link {built}/a.o {built}/b.o {built}/c.o\n")
    return built, here


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_a_build_begun_here_is_finished_there_with_only_what_is_left(tmp_path: Path) -> None:
    built, here = _project(tmp_path)
    subprocess.run(["ninja", "-C", str(built), str(built / "a.o")], check=True, capture_output=True)
    (built / "b.o").write_bytes(b"half written")  # on disk, but ninja has not logged it
    handoff = tmp_path / "handoff"
    packed = _run("pack", str(handoff), env={
        "WS": str(tmp_path / "ws"), "CUDA_HOME": str(here["cuda"]),
        "PYTHONPATH": f"{here['site']}:{here['tvm']}"})
    assert "1 objects built, 2 to build" in packed.stdout
    assert "b.o" in (handoff / "rest.sh").read_text()

    # The other machine: the same things at other paths, and no workspace.
    there = {name: tmp_path / f"{name}_there" for name in here}
    for name in here:
        here[name].rename(there[name])
    shutil.rmtree(tmp_path / "ws")
    # Were a.o built again, from here its source would give 0.
    (there["site"] / "flashinfer/data/a.cpp").write_text("int from_here() { return 0; }\n")
    _run("finish", str(handoff), str(there["site"]), str(tmp_path / "kept"), env={
        "CUDA_HOME": str(there["cuda"]), "PYTHONPATH": f"{there['site']}:{there['tvm']}"})

    module = there["site"] / "flashinfer/data/aot/fused_moe_90/fused_moe_90.so"
    assert ctypes.CDLL(str(module)).answer() == 42
    assert (tmp_path / "kept/SHA256SUMS").exists()


def test_objects_compiled_elsewhere_come_back_and_count_as_done(tmp_path: Path) -> None:
    built, here = _project(tmp_path)
    subprocess.run(["ninja", "-C", str(built), str(built / "a.o")], check=True, capture_output=True)
    env = {"WS": str(tmp_path / "ws"), "CUDA_HOME": str(here["cuda"]),
           "PYTHONPATH": f"{here['site']}:{here['tvm']}"}
    handoff = tmp_path / "handoff"
    _run("pack", str(handoff), env=env)
    # c.o marked done already (say, merged from elsewhere): compile leaves it alone.
    (built / "c.o").write_bytes(b"from elsewhere")
    (built / "c.o.ok").touch()
    _run("compile", str(handoff), str(here["site"]), env={**env, "JOBS": "1", "ORDER": "reverse"})
    assert (built / "c.o").read_bytes() == b"from elsewhere"
    assert (built / "b.o.ok").exists() and (built / "b.o").stat().st_size > 100
    times = [line.split() for t in built.glob("times.*.txt") for line in t.read_text().splitlines()]
    assert [t[2] for t in times] == [str(built / "b.o")] and float(times[0][1]) >= float(times[0][0])

    kept = tmp_path / "back"
    _run("collect", str(handoff), str(kept), env=env)
    compiled = (built / "b.o").read_bytes()
    for name in ("b.o", "b.o.ok", "c.o", "c.o.ok"):
        (built / name).unlink()
    _run("merge", str(kept), env=env)
    assert (built / "b.o").read_bytes() == compiled and (built / "c.o.ok").exists()
    repacked = _run("pack", str(tmp_path / "again"), env=env)
    assert "3 objects built, 0 to build" in repacked.stdout
