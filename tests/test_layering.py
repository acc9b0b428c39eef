"""The packages import one way, db <- runtime <- {serving, tuner} <- cli, and only the vLLM
adapter (runtime.vllm, serving) imports vllm: import-linter checks the contracts in
pyproject.toml against every import in the source (lazy ones inside functions included).

It runs in a child process: import-linter configures logging with ``dictConfig``, which would
disable every logger this process already has (moetune's included, and the tests read it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True))")


def test_packages_import_one_way():
    run = subprocess.run([sys.executable, "-c", LINT, str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 kept, 0 broken" in run.stdout
