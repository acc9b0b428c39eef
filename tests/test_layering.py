"""The packages import one way, db <- runtime <- tuner: import-linter checks the contract in
pyproject.toml against every import in the source (lazy ones inside functions included)."""

from __future__ import annotations

from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_packages_import_one_way(capsys):
    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "1 kept, 0 broken" in out
