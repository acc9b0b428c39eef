"""What FlashInfer's CUTLASS fused-MoE JIT build costs, in CPU time, on any machine with nvcc.

``cutlass_fused_moe`` builds ``fused_moe_90`` at its first call on Hopper: 248 compile units (220
generated CUTLASS GEMM instantiations, 28 of FlashInfer's and TensorRT-LLM's sources), cached in
``~/.cache/flashinfer`` only for the machine it ran on. No GPU is needed to compile them, so this
script writes the JIT's own build (``gen_cutlass_fused_moe_sm90_module().write_ninja()``, the
same spec ``probe_flashinfer.py --build`` runs), groups its units by kind (a generated file's name
less its group number, else the source's name), compiles ``--per-kind`` units of each kind with the
JIT's own commands, ``--jobs`` at a time, and projects the build: each kind's mean time times its
units. ``--per-kind 0`` compiles them all (the build itself, without the link).

    python scripts/flashinfer_build_cost.py --cuda-home DIR [--per-kind 1] [--jobs 1] \\
        [--json cost.jsonl] > cost.md
    python scripts/flashinfer_build_cost.py --ninja-log WS/.../fused_moe_90/.ninja_log > cost.md

``--ninja-log`` reads a whole build instead (``scripts/flashinfer_aot_build.sh``'s, resumed or
not): each unit's seconds from ninja's log, which are CPU seconds where the build ran no more jobs
than cores and nothing else competed (it runs at nice 19: on a busy machine they are more).

``DIR`` holds ``bin/nvcc`` and the CUDA headers; pip's ``nvidia-cuda-nvcc``, ``-crt``,
``-runtime``, ``-cccl`` and ``nvidia-nvvm`` wheels (13.0) with the headers of ``nvidia-cublas``,
``nvidia-cuda-nvrtc`` and ``nvidia-curand`` (TensorRT-LLM's reduce utilities include
``curand_kernel.h``) unpacked into one ``nvidia/cu13`` are enough. FlashInfer must import
(``PYTHONPATH``: the package and apache-tvm-ffi). Times are one machine's: compare them only with
others taken on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def units(cuda_home: Path, workspace: Path) -> list[dict]:
    """The JIT's compile commands for ``fused_moe_90`` (``directory``, ``command``, ``file``)."""
    os.environ.update(CUDA_HOME=str(cuda_home), FLASHINFER_CUDA_ARCH_LIST="9.0a",
                      FLASHINFER_WORKSPACE_BASE=str(workspace))
    os.environ["PATH"] = f"{cuda_home / 'bin'}:{os.environ['PATH']}"
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    spec = gen_cutlass_fused_moe_sm90_module()
    spec.write_ninja()
    return [{**c, "file": c["command"].split(" -c ", 1)[1].split()[0]}
            for c in spec.get_compile_commands()]


def kind(source: str) -> str:
    """A generated instantiation's kind is its name less the group number; a source is its own."""
    return re.sub(r"_group\d+\.generated\.cu$", "", Path(source).name)


def compile_one(unit: dict) -> dict:
    start = time.perf_counter()
    run = subprocess.run(unit["command"], shell=True, cwd=unit["directory"], check=False,
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"{unit['file']} did not compile:\n{run.stderr[-2000:]}")
    return {"file": Path(unit["file"]).name, "kind": kind(unit["file"]),
            "s": time.perf_counter() - start}


def from_ninja_log(log: Path) -> list[dict]:
    """Each unit of a build as ninja logged it (start and end in ms, then the object): the last
    entry of an object counts, and its file is the source's name (``x.generated.cuda.o`` ->
    ``x.generated.cu``), so it groups by kind as the compiled units do."""
    latest: dict[str, float] = {}
    for line in log.read_text().splitlines()[1:]:
        start, end, _, out, _ = line.split("\t")
        if out.endswith(".o"):
            latest[out] = (int(end) - int(start)) / 1000
    units = []
    for out, s in latest.items():
        source = re.sub(r"(\.cuda)?\.o$", ".cu", Path(out).name)
        units.append({"file": source, "kind": kind(source), "s": s})
    return units


def report(all_units: list[dict], timed: list[dict], jobs: int, cores: int) -> str:
    """Per kind: units, compiled, seconds each; the projected CPU time of the whole build."""
    count: dict[str, int] = defaultdict(int)
    for u in all_units:
        count[kind(u["file"])] += 1
    seconds: dict[str, list[float]] = defaultdict(list)
    for t in timed:
        seconds[t["kind"]].append(t["s"])
    rows, total = [], 0.0
    for k in sorted(count, key=lambda k: -count[k] * statistics.mean(seconds[k] or [0])):
        mean = statistics.mean(seconds[k]) if seconds[k] else float("nan")
        total += count[k] * mean
        times = ", ".join(f"{s:.0f}" for s in sorted(seconds[k])) or "-"
        rows.append(f"| {k} | {count[k]} | {times} | {count[k] * mean / 60:.1f} |")
    nl = "\n"
    return f"""# FlashInfer's fused_moe_90 JIT build: CPU time by kind of unit

- host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; Python \
{platform.python_version()}
- units: {len(all_units)}; compiled here: {len(timed)}, \
{f"{jobs} at a time" if jobs else "times from the build's ninja log"}
- command: `{" ".join(["python", *sys.argv])}`

| kind | units | seconds per unit compiled here | projected CPU minutes |
| --- | --- | --- | --- |
{nl.join(rows)}

Projected: {total / 3600:.2f} CPU-hours; at best {total / 60 / cores:.0f} minutes on {cores} cores \
that compile as fast as these, the link not counted.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda-home", type=Path)
    parser.add_argument("--ninja-log", type=Path, help="a whole build's .ninja_log, read instead "
                        "of compiling")
    parser.add_argument("--per-kind", type=int, default=1, help="units compiled per kind (0: all)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--json", type=Path, help="each compiled unit's time, a JSON line as it "
                        "ends (appended)")
    parser.add_argument("--cores", type=int, default=16, help="the build host's cores, for the "
                        "projection (the GPU machine's: 16)")
    args = parser.parse_args()
    if args.ninja_log:
        logged = from_ninja_log(args.ninja_log)
        print(report(logged, logged, jobs=0, cores=args.cores))
        return
    if args.cuda_home is None:
        parser.error("--cuda-home or --ninja-log")
    with tempfile.TemporaryDirectory() as work:
        all_units = units(args.cuda_home.resolve(), Path(work))
        chosen, taken = [], defaultdict(int)
        for u in all_units:
            if args.per_kind == 0 or taken[kind(u["file"])] < args.per_kind:
                taken[kind(u["file"])] += 1
                chosen.append(u)
        timed = []
        with ThreadPoolExecutor(args.jobs) as pool:
            for result in pool.map(compile_one, chosen):
                timed.append(result)
                if args.json:  # unit by unit: a run stopped early keeps what it measured
                    with args.json.open("a") as f:
                        f.write(json.dumps(result) + "\n")
    print(report(all_units, timed, args.jobs, args.cores))


if __name__ == "__main__":
    main()
