"""What a user installs (moetune is on no package index): a built wheel must carry the shipped
tables, the migrations, the plugin's entry point and the command, and no top-level packages of
its own names; the ``vllm`` extra must resolve to a vLLM release the plugin serves."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from moetune.runtime.vllm import versions

ROOT = Path(__file__).resolve().parents[1]


def test_a_built_wheel_carries_tables_migrations_and_entry_points(tmp_path):
    # Built from a copy: a build leaves build/ and an egg-info beside the sources, whose stale
    # entry points would shadow the installed ones wherever the checkout is on sys.path.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".whl", "bench", "tests", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(source)], check=True,
                   capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("moetune-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tables = {p.name for p in (ROOT / "runtime" / "tables").glob("*.db")}
    assert tables and {f"moetune/runtime/tables/{t}" for t in tables} <= names
    migrations = {p.name for p in (ROOT / "db" / "migrations" / "versions").glob("0*.py")}
    assert {f"moetune/db/migrations/versions/{m}" for m in migrations} <= names
    assert {"moetune/db/migrations/script.py.mako", "moetune/db/migrations/env.py",
            "moetune/serving/plugin.py", "moetune/runtime/vllm/versions.py",
            "moetune/cli.py"} <= names
    assert {n.split("/")[0] for n in names if not n.startswith("moetune-")} == {"moetune"}
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "moetune = moetune.serving.plugin:register" in text
    assert "moetune = moetune.cli:app" in text


def test_the_vllm_extra_resolves_a_release_the_plugin_serves(tmp_path):
    """What ``pip install ".[vllm]"`` picks in a fresh environment today (resolved, not
    installed: pip's report of what it would install)."""
    venv.create(tmp_path / "env", with_pip=True)
    report = tmp_path / "report.json"
    subprocess.run([str(tmp_path / "env" / "bin" / "python"), "-m", "pip", "install", "-q",
                    "--dry-run", "--ignore-installed", "--report", str(report),
                    f"{ROOT}[vllm]"], check=True, capture_output=True, timeout=900)
    picked = {i["metadata"]["name"]: i["metadata"]["version"]
              for i in json.loads(report.read_text())["install"]}
    assert versions.unsupported(picked["vllm"]) is None, picked["vllm"]
