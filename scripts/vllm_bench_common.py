"""What the vLLM engine benchmarks share: each engine in a fresh process, and where a report says
it ran (machine, commit).

Used by ``scripts/bench_vllm_plugin.py`` (tiny model on the CPU) and
``scripts/bench_vllm_e2e.py`` (real-size model, CUDA or CPU).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_child(script: str, argv: list[str], out: Path, log: Path | None = None,
              **env: str) -> dict:
    """Run ``script --child *argv`` in a fresh interpreter with ``env`` added to this process's
    environment less its ``MOETUNE_*`` settings, and return the JSON it wrote to ``out``;
    its output, stdout and stderr interleaved (vLLM logs to stdout, the plugin to stderr), goes
    to ``log`` if given.

    Exits with the child's output tail if it failed, naming ``env``.
    """
    full = {k: v for k, v in os.environ.items() if not k.startswith("MOETUNE_")} | env
    proc = subprocess.run([sys.executable, script, "--child", *argv], env=full,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          check=False)
    if log:
        log.write_text(proc.stdout)
    if proc.returncode:
        sys.exit(f"engine run failed ({env}):\n{proc.stdout[-4000:]}")
    return json.loads(out.read_text())


def machine() -> str:
    """CPU model, cores, memory and Python version of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in
                   Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}"


def commit() -> str:
    """HEAD of this checkout, and whether the tree has uncommitted changes."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()
    return git("rev-parse", "HEAD") + (" plus uncommitted changes" if git("status", "--porcelain")
                                       else "")
