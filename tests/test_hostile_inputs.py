"""Regression tests for the hostile-user report: every corrupt row, impossible number and bad
argument in it gives one ``error:`` line or a listed bad row, never a traceback, and no command
loses stored data."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess

import pytest
from typer.testing import CliRunner

from moetune import db
from moetune.cli import app
from moetune.runtime.dispatcher import Dispatcher
from moetune.tuner.presets import preset

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def corrupt(tiny_table, path, assignment, num_tokens=16):
    """A copy of the tiny table with one winner's columns set by SQL (foreign keys off)."""
    shutil.copyfile(tiny_table, path)
    with sqlite3.connect(path) as con:
        con.execute("PRAGMA foreign_keys=OFF")
        con.execute(f"UPDATE winner SET {assignment} WHERE bucket_id = "
                    "(SELECT id FROM bucket WHERE num_tokens = ?)", (num_tokens,))
    return path


CORRUPT_ROWS = {
    "baseline_without_kernel": ("""baselines = '{"variants":[{"params":{}}]}'""",
                                "variant 0: no kernel name"),
    "dangling_sku": ("sku_id = 99", "its SKU 99 does not exist"),
    "dangling_run": ("run_id = 99", "its run 99 does not exist"),
    "dangling_bucket": ("bucket_id = 99", "its bucket 99 does not exist"),
    "integer_params": ("params = 5", "expected a JSON object, got int"),
    "blob_params": ("params = x'00ff'", "expected JSON text, got bytes"),
    "deep_params": ("params = '" + "[" * 100_000 + "]" * 100_000 + "'", "nested deeper"),
    "negative_median": ("median_us = -5", "median_us is -5.0, not a finite positive number"),
    "zero_median": ("median_us = 0", "median_us is 0.0, not a finite positive number"),
    "null_median": ("median_us = NULL", "median_us is missing"),
    "text_median": ("median_us = 'fast'", "median_us is 'fast'"),
    "bogus_source": ("source = 'bogus'", "source 'bogus' is not one of"),
    "speedup_107x": ("speedup = 107", "speedup 107 does not follow from the times"),
    "garbage_updated_at": ("updated_at = 'garbage'", "updated_at is 'garbage', not a date"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_ROWS))
def test_a_corrupt_row_is_named_by_every_command_and_skipped_by_serving(tiny_table, tmp_path,
                                                                        cpu_sku, case):
    assignment, reason = CORRUPT_ROWS[case]
    table = corrupt(tiny_table, tmp_path / "t.db", assignment)
    before = table.read_bytes()
    shown = invoke("show", table, "--json", "--device", "cpu")
    assert shown.exit_code == 0, shown.output
    bad = [json.loads(line) for line in shown.output.splitlines() if '"bad_row"' in line]
    assert len(bad) == 1 and reason in bad[0]["served_reason"]
    exported = invoke("export", table, "--output", tmp_path / "x.db")
    assert exported.exit_code == 0, exported.output
    assert "exported 2 rows" in exported.output and reason in exported.output
    strict = invoke("merge", table, tiny_table, "--output", tmp_path / "m.db", "--strict")
    assert strict.exit_code == 1 and "not written, invalid winners" in strict.output
    assert reason in strict.output and not (tmp_path / "m.db").exists()
    looked_up = invoke("lookup", "--table", table, "--preset", "tiny", "--num-tokens", 16,
                       "--device", "cpu")
    assert looked_up.exit_code == 0, looked_up.output
    dispatcher = Dispatcher.load(table, cpu_sku, check_environment=False)
    problem = preset("tiny").shape.problem(16)
    assert 16 not in dispatcher.buckets(problem.shape)
    assert dispatcher.select(problem).bucket != 16  # a neighbour's winner or the rule
    if case not in ("dangling_sku", "dangling_bucket"):  # still this SKU's, at this bucket
        assert reason in dispatcher.faults(problem.shape)[16]
    assert table.read_bytes() == before
    for result in (shown, exported, strict, looked_up):
        assert "Traceback" not in result.output and result.exception is None or \
            isinstance(result.exception, SystemExit)


def test_merge_never_prefers_an_impossible_time(tiny_table, tmp_path):
    table = corrupt(tiny_table, tmp_path / "t.db", "median_us = -5")
    result = invoke("merge", table, tiny_table, "--output", tmp_path / "m.db")
    assert result.exit_code == 0, result.output
    merged = {r.bucket["num_tokens"]: r.median_us for r in db.read_winners(tmp_path / "m.db").rows}
    assert merged[16] > 0 and "median_us is -5.0" in result.output


@pytest.mark.parametrize("args", [
    ("export", "{t}", "--output", "{t}"),
    ("export", "{t}", "--output", "sqlite:///{t}"),
    ("merge", "{t}", "{t}", "--output", "{t}"),
    ("import", "{t}", "--output", "{t}"),
])
def test_an_output_that_is_an_input_refuses_and_loses_nothing(tiny_table, tmp_path, args):
    table = tmp_path / "t.db"
    shutil.copyfile(tiny_table, table)
    before = table.read_bytes()
    result = invoke(*(a.format(t=table) for a in args))
    assert result.exit_code == 1 and "it is also an input" in result.output
    assert table.read_bytes() == before


def test_a_table_of_a_newer_schema_is_never_overwritten(tiny_table, tmp_path):
    future = tmp_path / "future.db"
    shutil.copyfile(tiny_table, future)
    with sqlite3.connect(future) as con:
        con.execute("UPDATE alembic_version SET version_num = '9999_future'")
    before = future.read_bytes()
    result = invoke("merge", tiny_table, tiny_table, "--output", future)
    assert result.exit_code == 1 and "newer moetune schema" in result.output
    assert future.read_bytes() == before


def test_an_output_that_cannot_be_replaced_fails_in_one_line_and_stays(tiny_table, tmp_path):
    out = tmp_path / "immutable.db"
    shutil.copyfile(tiny_table, out)
    if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not allowed here")
    try:
        before = out.read_bytes()
        result = invoke("export", tiny_table, "--output", out)
        assert result.exit_code == 1
        assert result.output.strip().splitlines() == [
            f"error: {out}: cannot replace it (Operation not permitted); left as it was"]
        assert out.read_bytes() == before
    finally:
        subprocess.run(["chattr", "-i", str(out)], check=True)


def test_a_sqlite_url_of_a_file_gets_the_files_locks_and_claims(tiny_table, tmp_path):
    table = tmp_path / "t.db"
    url = f"sqlite:///{table}"
    assert not db.is_url(url) and db.file_path(url) == table
    result = invoke("export", tiny_table, "--output", url)
    assert result.exit_code == 0, result.output
    with db.claim_in(url, "bucket 1") as mine, db.claim_in(table, "bucket 1") as theirs:
        assert mine and not theirs  # the URL and the path hold one claim
    assert db.read_winners(url).rows == db.read_winners(table).rows


@pytest.mark.parametrize(("args", "message"), [
    (("tune", "-o", "{tmp}/x.db", "--preset", "tiny", "--buckets", str(2**64)),
     "--buckets must be integers from 1 to"),
    (("tune", "-o", "{tmp}/x.db", "--hidden", str(2**64), "--intermediate", "64", "--experts",
      "8", "--topk", "2"), "hidden_size must be an integer from 1 to"),
    (("tune", "-o", "{tmp}/x.db", "--preset", "tiny", "--seed", str(2**64)),
     "Invalid value for '--seed'"),
    (("tune", "-o", "{tmp}/x.db", "--from-misses", "{tmp}/binary"), "cannot read misses file"),
    (("tune", "-o", "{tmp}/x.db", "--preset", "tiny", "--buckets", "1", "--device", "cpu",
      "--optuna-storage", "garbage://x"), "--optuna-storage garbage://x: cannot open it"),
    (("import", "{tmp}/vllm_sup", "-o", "{tmp}/i.db", "--hidden", "128", "--topk", "2"),
     "entry '²' must map a token count"),
    (("import", "{tmp}/vllm_deep", "-o", "{tmp}/i.db", "--hidden", "128", "--topk", "2"),
     "cannot read JSON"),
    (("export", "{table}", "-o", "{tmp}/\udcff.db"), "a table file's name must be valid UTF-8"),
    (("export", "{table}", "-o", "/proc/x", "--format", "vllm"), "nothing to export"),
    (("lookup", "--preset", "tiny", "--num-tokens", "1", "--table", "{tmp}/missing.db",
      "--device", "cpu"), "no such table file"),
    (("lookup", "--preset", "tiny", "--num-tokens", "1", "--table", "{tmp}/binary",
      "--device", "cpu"), "not a moetune table"),
    (("lookup", "--preset", "tiny", "--tp", "0", "--num-tokens", "1"), "must be positive"),
    (("lookup", "--preset", "tiny", "--tp", "3", "--num-tokens", "1"), "shard a --config"),
    (("lookup", "--hidden", "64", "--intermediate", "64", "--experts", "8", "--topk", "2",
      "--ep", "-1", "--num-tokens", "1"), "must be positive"),
    (("tune", "-o", "{tmp}/x.db", "--preset", "tiny", "--dtype", "float8"),
     "'float8' is not one of"),
    (("tune", "-o", "{tmp}/x.db", "--preset", "tiny", "--reps", "1"), "Invalid value for '--reps'"),
    (("lookup", "--preset", "tiny", "--num-tokens", "0"), "Invalid value for '--num-tokens'"),
    (("export", "{table}", "-o", "{tmp}/x", "--format", "parquet"), "'parquet' is not one of"),
    (("no-such-command",), "No such command"),
    *((((command, "--device", "cuda", *extra), "GPU visible to torch")
       for command, *extra in (("tune", "-o", "{tmp}/x.db", "--preset", "tiny"),
                               ("show", "{table}"), ("doctor",), ("adopt",),
                               ("lookup", "--preset", "tiny", "--num-tokens", "1")))),
])
def test_each_bad_input_is_one_error_line_and_exit_1(tiny_table, tmp_path, args, message):
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (tmp_path / "binary").write_bytes(b"\x00\xff\xfe binary")
    for name, content in (("vllm_sup", '{"\u00b2": {}}'),
                          ("vllm_deep", '{"1": ' + "[" * 100_000 + "]" * 100_000 + "}")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "E=8,N=256,device_name=NVIDIA_H200.json").write_text(content)
    result = invoke(*(a.format(tmp=tmp_path, table=tiny_table) for a in args))
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in result.output, result.output
    assert "Traceback" not in result.output and "╭" not in result.output
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "i.db").exists()


def test_a_run_of_garbage_status_drops_its_winners_and_the_rest_is_merged(tiny_table, tmp_path):
    """A run's status or a winner's time stamp edited into garbage made ``merge`` and ``export``
    fail as a whole; now its winners are dropped with a line each and the rest is written."""
    table = tmp_path / "t.db"
    shutil.copyfile(tiny_table, table)
    with sqlite3.connect(table) as con:
        con.execute("UPDATE tuning_run SET status = 'bogus'")
    merged = invoke("merge", table, tiny_table, "--output", tmp_path / "m.db")
    assert merged.exit_code == 0, merged.output
    assert merged.output.count("its run's status 'bogus' is not one of") == 3
    assert len(db.read_winners(tmp_path / "m.db").rows) == 3  # all of the intact table's
    exported = invoke("export", table, "--output", tmp_path / "x.db")  # nothing valid is left
    assert exported.exit_code == 1 and "every winner is invalid" in exported.output
    assert not (tmp_path / "x.db").exists()


VLLM_CONFIG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
               "num_warps": 4, "num_stages": 2}


def test_a_vllm_entry_past_2_31_is_skipped_and_the_rest_imported(tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "E=8,N=256,device_name=NVIDIA_H200.json").write_text(json.dumps(
        {str(2**31): VLLM_CONFIG, str(2**64): VLLM_CONFIG, "9" * 5000: VLLM_CONFIG,
         "1": VLLM_CONFIG, "16": VLLM_CONFIG}))
    result = invoke("import", folder, "-o", tmp_path / "i.db", "--hidden", 128, "--topk", 2)
    assert result.exit_code == 0, result.output
    assert "imported 2 rows" in result.output
    assert result.output.count("num_tokens must be an integer from 1 to 2147483647") == 3
    assert "entry 2147483648:" in result.output and "entry 99999999999999999...:" in result.output
    rows = db.read_winners(tmp_path / "i.db").rows
    assert sorted(r.bucket["num_tokens"] for r in rows) == [1, 16]


def test_import_into_a_sqlite_url_writes_its_file_with_the_files_locks(tiny_table, tmp_path):
    """``import --output sqlite:///PATH`` is the file at PATH (before, a file named after the
    URL's text): created, merged into when it exists, refused when it is the input."""
    table = tmp_path / "t.db"
    url = f"sqlite:///{table}"
    first = invoke("import", tiny_table, "--output", url)
    assert first.exit_code == 0 and f"-> {table}" in first.output, first.output
    again = invoke("import", tiny_table, "--output", url)  # the same rows: merged, not doubled
    assert again.exit_code == 0, again.output
    assert len(db.read_winners(table).rows) == len(db.read_winners(tiny_table).rows)
    before = table.read_bytes()
    itself = invoke("import", table, "--output", url)
    assert itself.exit_code == 1 and "it is also an input" in itself.output
    assert table.read_bytes() == before
    server = invoke("import", tiny_table, "--output", "postgresql://u:secret@host/db")
    assert server.exit_code == 1 and "import writes a table file" in server.output
    assert "secret" not in server.output
