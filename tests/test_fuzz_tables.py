"""Property tests: real tables corrupted field by field and at random (types, ranges, NULLs,
dangling references, huge and nested JSON, truncated files). For every command and for the
dispatcher: no traceback, exit 0 or 1 (1 with an ``error:`` line), valid rows still served, and
no existing file changed by a command that failed or only reads.

Bounded for CI: fixed example counts, derandomized, about a minute on a 2-core CPU.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from moetune.cli import app
from moetune.runtime.dispatcher import Dispatcher
from moetune.tuner.presets import preset

FUZZ = settings(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
BUCKETS = (1, 16, 64)
SHAPE = preset("tiny").shape
WINNER_COLUMNS = ("sku_id", "bucket_id", "kernel", "params", "source", "median_us", "p20_us",
                  "p80_us", "error", "baseline_kernel", "baseline_params", "baseline_us",
                  "speedup", "baselines", "run_id", "updated_at")
BUCKET_COLUMNS = ("num_tokens", "hidden_size", "intermediate_size", "num_experts", "topk",
                  "dtype", "quant", "activation", "gated", "router_weight_on_input")
RUN_COLUMNS = ("environment", "status", "started_at", "sku_id")

runner = CliRunner()

#: What a damaged or hostile table may hold in any column: SQLite keeps whatever it is given.
VALUES = st.one_of(
    st.none(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, -1, 2**31, 99]),
    st.floats(allow_nan=False),  # SQLite stores NaN as NULL
    st.sampled_from([float("inf"), -float("inf"), 1e308, 5e-324]),
    st.text(max_size=40),
    st.binary(max_size=20),
    st.sampled_from(['{"variants":[{"params":{}}]}', '{"variants":[1]}', '{"variants":{}}',
                     "[]", "{}", '{"a":null}', "null", "{not json", "bogus", "measured",
                     "aiter-csv", "2026-13-45 99:99:99", "running", "torch_loop",
                     "[" * 10_000 + "]" * 10_000, '{"k":"' + "x" * 200_000 + '"}']),
)


def _served(path: Path, sku) -> dict[int, str]:
    """num_tokens -> kernel of the rows the dispatcher serves from ``path`` for the tiny shape."""
    d = Dispatcher.load(path, sku, check_environment=False)
    for m in (1, 2, 16, 40, 64, 4096):
        d.select(SHAPE.problem(m))  # never raises, whatever the table holds
    d.status  # judges every row
    return {m: d.select(SHAPE.problem(m)).kernel for m in d.buckets(SHAPE)}


@contextlib.contextmanager
def _corrupted(tiny_table: Path, edits: list[tuple[str, str, int, object]]) -> Iterator[Path]:
    """A copy of ``tiny_table`` with ``edits`` applied: (table, column, row number, value)."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        path = Path(tmp) / "t.db"
        shutil.copyfile(tiny_table, path)
        with contextlib.closing(sqlite3.connect(path)) as con, con:
            con.execute("PRAGMA foreign_keys=OFF")
            for table, column, row, value in edits:
                ids = [i for (i,) in con.execute(f"SELECT id FROM {table} ORDER BY id")]
                with contextlib.suppress(sqlite3.IntegrityError):  # NOT NULL, UNIQUE
                    con.execute(f"UPDATE {table} SET {column} = ? WHERE id = ?",
                                (value, ids[row % len(ids)]))
        yield path


def _check_commands(table: Path, original: Path) -> None:
    """Every command on ``table``: exit 0 or 1 with an ``error:`` line, no traceback, inputs
    unchanged, and an existing output unchanged when the command fails."""
    work = table.parent
    before = table.read_bytes()
    existing = work / "existing.db"
    shutil.copyfile(original, existing)
    kept = existing.read_bytes()
    commands = [
        ("show", table, "--device", "cpu"),
        ("show", table, "--json", "--device", "cpu"),
        ("lookup", "--table", table, "--preset", "tiny", "--num-tokens", 16, "--device", "cpu"),
        ("export", table, "--output", existing),
        ("export", table, "--output", work / "cfg", "--format", "vllm"),
        ("merge", table, original, "--output", existing),
        ("merge", table, original, "--output", existing, "--strict"),
        ("import", table, "--output", existing),
    ]
    for args in commands:
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code in (0, 1), (args, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), \
            (args, result.output, result.exception)
        assert "Traceback" not in result.output
        if result.exit_code == 1:
            assert "error: " in result.output, (args, result.output)
            assert existing.read_bytes() == kept, args
        else:
            kept = existing.read_bytes()
        assert table.read_bytes() == before, args


@pytest.fixture(scope="module")
def served_before(tiny_table, cpu_sku) -> dict[int, str]:
    return _served(tiny_table, cpu_sku)


@pytest.mark.parametrize("column", WINNER_COLUMNS + BUCKET_COLUMNS)
@settings(FUZZ, max_examples=3)
@given(value=VALUES, row=st.sampled_from(range(3)))
def test_one_field_of_one_row_corrupted_leaves_the_others_served(tiny_table, cpu_sku,
                                                                 served_before, column, value,
                                                                 row):
    table = "winner" if column in WINNER_COLUMNS else "bucket"
    with _corrupted(tiny_table, [(table, column, row, value)]) as path:
        served = _served(path, cpu_sku)
    hit = BUCKETS[row]
    assert {m: k for m, k in served.items() if m != hit} == \
        {m: k for m, k in served_before.items() if m != hit}


EDITS = st.lists(st.one_of(
    st.tuples(st.just("winner"), st.sampled_from(WINNER_COLUMNS), st.integers(0, 2), VALUES),
    st.tuples(st.just("bucket"), st.sampled_from(BUCKET_COLUMNS), st.integers(0, 2), VALUES),
    st.tuples(st.just("tuning_run"), st.sampled_from(RUN_COLUMNS), st.just(0), VALUES),
), min_size=1, max_size=4)


@settings(FUZZ, max_examples=20)
@given(edits=EDITS)
def test_random_corruption_never_crashes_a_command_nor_changes_a_file(tiny_table, edits):
    with _corrupted(tiny_table, edits) as path:
        _check_commands(path, tiny_table)


@settings(FUZZ, max_examples=5)
@given(cut=st.floats(0.0, 0.99), flip=st.integers(0, 2**16))
def test_a_truncated_or_damaged_file_is_one_error_line(tiny_table, cpu_sku, cut, flip):
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        path = Path(tmp) / "t.db"
        data = bytearray(tiny_table.read_bytes())
        data[flip % len(data)] ^= 0xFF
        path.write_bytes(bytes(data[:max(1, int(len(data) * cut))] if cut else data))
        _served(path, cpu_sku)  # falls back to the rules, says why in status
        _check_commands(path, tiny_table)


@settings(FUZZ, max_examples=12)
@given(key=st.one_of(st.text(max_size=8), st.integers().map(str)),
       value=st.one_of(st.integers(), st.text(max_size=8), st.none()),
       row=st.lists(st.one_of(st.integers().map(str), st.text(max_size=6)), min_size=1,
                    max_size=4))
def test_import_of_hostile_vllm_and_aiter_files_is_exit_0_or_one_error_line(key, value, row):
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        work = Path(tmp)
        folder = work / "vllm"
        folder.mkdir()
        config = dict.fromkeys(("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M",
                                "num_warps", "num_stages"), 16)
        (folder / "E=8,N=256,device_name=NVIDIA_H200.json").write_text(
            json.dumps({key: {**config, "BLOCK_SIZE_M": value}, "1": config}))
        csv = work / "tuned_fmoe.csv"
        header = ("cu_num,token,model_dim,inter_dim,expert,topk,act_type,dtype,q_dtype_a,"
                  "q_dtype_w,q_type,use_g1u1,doweight_stage1,block_m,ksplit,us")
        fields = [*row, *["80", "1", "4096", "1024", "8", "2", "ActivationType.Silu",
                          "torch.bfloat16", "torch.bfloat16", "torch.bfloat16",
                          "QuantType.No", "1", "0", "32", "0", "10.0"][len(row):]]
        csv.write_text(header + "\n" + ",".join(f.replace(",", "").replace("\n", "")
                                                for f in fields) + "\n")
        for args in (("import", folder, "-o", work / "v.db", "--hidden", 4096, "--topk", 2),
                     ("import", csv, "-o", work / "a.db")):
            result = runner.invoke(app, [str(a) for a in args])
            assert result.exit_code in (0, 1), result.output
            assert result.exception is None or isinstance(result.exception, SystemExit), \
                (args, result.output, result.exception)
            if result.exit_code == 1:
                assert "error: " in result.output


ARGUMENT = st.one_of(st.integers(min_value=-(2**70), max_value=2**70).map(str),
                     st.text(max_size=12).filter(lambda s: not s.startswith("-")),
                     st.sampled_from(["0", "1", "3", "8", "128", "bfloat16", "fp8_per_tensor",
                                      "gelu", "²", "1e3", ""]))


@settings(FUZZ, max_examples=30)
@given(values=st.fixed_dictionaries({}, optional={
    option: ARGUMENT for option in ("--num-tokens", "--hidden", "--intermediate", "--experts",
                                    "--topk", "--tp", "--ep", "--dtype", "--quant",
                                    "--activation", "--preset")}))
def test_random_arguments_are_exit_0_or_one_error_line(values):
    """``lookup`` takes every shape option tune and import take, and runs no kernel."""
    args = ["lookup", "--device", "cpu"]
    for option, value in values.items():
        args += [option, value]
    result = runner.invoke(app, args)
    assert result.exit_code in (0, 1), (args, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        (args, result.output, result.exception)
    if result.exit_code == 1:
        errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, (args, result.output)
