"""Typed options: dtype, quant and activation take the enums' values, listed in ``--help``, and
anything else is refused before any work with the valid values named."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moetune.runtime.problem import Activation, DType, QuantScheme
from moetune.cli import app


@pytest.mark.parametrize("option,kind", [("--dtype", DType), ("--quant", QuantScheme),
                                         ("--activation", Activation)])
def test_enum_options_list_their_values_and_refuse_others(tmp_path, option, kind):
    runner = CliRunner()
    shown = runner.invoke(app, ["tune", "--help"], env={"COLUMNS": "400"}).output
    listed = shown.split(option, 1)[1].split("\n", 1)[0]
    assert all(m.value in listed for m in kind), listed
    result = runner.invoke(app, ["tune", "--preset", "tiny", option, "int3", "--output",
                                 str(tmp_path / "x.db")])
    assert result.exit_code == 1 and "int3" in result.output
    assert all(m.value in result.output for m in kind)
    assert not (tmp_path / "x.db").exists()


def test_enum_options_ignore_case_and_reach_the_command_as_enums():
    import typer

    tune = typer.main.get_command(app).commands["tune"]
    ctx = tune.make_context("tune", ["--output", "x.db", "--dtype", "BFloat16", "--quant",
                                     "FP8_PER_CHANNEL", "--activation", "GELU"])
    assert (ctx.params["dtype"], ctx.params["quant"], ctx.params["activation"]) == (
        DType.BFLOAT16, QuantScheme.FP8_PER_CHANNEL, Activation.GELU)


@pytest.mark.parametrize("command", ["tune", "lookup", "export", "import", "report"])
def test_help_in_a_narrow_terminal_names_every_option_whole(command):
    shown = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"}).output
    assert "…" not in shown and "`" not in shown
    if command in ("tune", "lookup"):
        assert "--router-weight-on-input / --router-weight-on-output" in shown
