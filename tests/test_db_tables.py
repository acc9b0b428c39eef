"""Writing and reading table files: the tuner's helpers, atomic writes, and the read API."""

import datetime
import os
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import func, select

from moetune.db import (
    BaselineRecord,
    BucketRow,
    Candidate,
    Measurement,
    MeasurementStatus,
    RunStatus,
    TuningRun,
    WinnerRecord,
    WinnerRow,
    add_measurement,
    dump_json,
    finish_run,
    get_or_create_bucket,
    get_or_create_sku,
    measured,
    open_table,
    read_measurements,
    read_winners,
    set_winner,
    start_run,
    write_table,
)
from moetune.errors import TableError

from .test_db_helpers import ENVIRONMENT, H200, MI300X, bucket_key, files_in, tune


def test_round_trip(tmp_path):
    path = tmp_path / "h200.db"
    tune(path, num_tokens=1, kernel="triton", params={"num_warps": 4, "BLOCK_M": 16}, median=8.0,
         spread=0.5, baseline=12.0)
    snapshot = read_winners(path)
    assert snapshot.path == path
    assert snapshot.bad_rows == []
    columns = ("vendor", "name", "arch", "compute_units", "memory_bytes")
    assert snapshot.skus == [dict(zip(columns, H200, strict=True))]
    assert snapshot.environment == ENVIRONMENT
    assert snapshot.rows == [WinnerRecord(
        sku=snapshot.skus[0], bucket=bucket_key(num_tokens=1), kernel="triton",
        params={"BLOCK_M": 16, "num_warps": 4}, median_us=8.0, p20_us=7.5, p80_us=8.5,
        error=1e-3, baseline_kernel="rule", baseline_params={}, baseline_us=12.0, speedup=1.5,
        run_id=1, baselines=(BaselineRecord(Candidate("rule", {}), median_us=12.0, beaten=True),),
        environment=ENVIRONMENT,
    )]
    trials = read_measurements(path)
    assert [(t["status"], t["median_us"], t["reason"]) for t in trials] == [
        ("ok", 8.0, None), ("failed", None, "out of resources")]
    assert trials[0]["params_json"] == '{"BLOCK_M":16,"num_warps":4}'


def test_read_measurements_filters_by_any_bucket_columns(tmp_path):
    path = tmp_path / "t.db"
    tune(path, num_tokens=1)
    tune(path, num_tokens=64)
    assert {t["bucket"]["num_tokens"] for t in read_measurements(path, {"num_tokens": 64})} == {64}
    assert len(read_measurements(path, {"dtype": "bfloat16", "gated": True})) == 4
    assert read_measurements(path, {"num_tokens": 2}) == []
    with pytest.raises(ValueError, match="unknown bucket columns"):
        read_measurements(path, {"tokens": 64})


def test_bucket_is_unique(tmp_path):
    path = tmp_path / "t.db"
    with write_table(path) as table, table.session() as s:
        first = get_or_create_bucket(s, **bucket_key())
        assert get_or_create_bucket(s, **bucket_key()).id == first.id
        assert get_or_create_bucket(s, **bucket_key(gated=False)).id != first.id
    with pytest.raises(TableError, match=f"{path}: UNIQUE constraint failed"):
        with open_table(path, writable=True) as table, table.session() as s:
            s.add(BucketRow(**bucket_key()))
    with open_table(path) as table, table.session() as s:
        assert s.scalar(select(func.count()).select_from(BucketRow)) == 2


def test_bucket_key_must_be_complete(tmp_path):
    with open_table(tmp_path / "t.db", writable=True) as table, table.session() as s:
        with pytest.raises(ValueError, match="missing \\['topk'\\]"):
            get_or_create_bucket(s, **{k: v for k, v in bucket_key().items() if k != "topk"})


def test_set_winner_upserts_and_computes_speedup(tmp_path):
    path = tmp_path / "t.db"
    tune(path, kernel="triton", median=10.0, baseline=15.0)
    tune(path, kernel="grouped_mm", params={"tile": 64}, median=4.0, baseline=16.0)
    [row] = read_winners(path).rows
    assert (row.kernel, row.params, row.median_us, row.speedup, row.run_id) == (
        "grouped_mm", {"tile": 64}, 4.0, 4.0, 2)
    with open_table(path, writable=True) as table, table.session() as s:
        sku, bucket = get_or_create_sku(s, *H200), get_or_create_bucket(s, **bucket_key())
        run = s.get(TuningRun, 1)
        for bad in (0.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="median_us must be a positive finite time"):
                set_winner(s, sku, bucket, run, "k", {}, bad, 1.0, 1.0, None, "rule", {}, 2.0)
        assert s.scalar(select(func.count()).select_from(WinnerRow)) == 1


def test_measured_finds_earlier_trials_of_this_sku_only(tmp_path):
    path = tmp_path / "t.db"
    tune(path, params={"num_warps": 4, "BLOCK_M": 16}, median=10.0, failed_trials=0)
    tune(path, params={"BLOCK_M": 16, "num_warps": 4}, median=9.0, failed_trials=1)
    tune(path, sku=MI300X, params={"BLOCK_M": 32}, median=7.0)
    with open_table(path, writable=True) as table, table.session() as s:
        sku, bucket = get_or_create_sku(s, *H200), get_or_create_bucket(s, **bucket_key())
        done = measured(s, sku, bucket)
    ok_key = ("triton", dump_json({"num_warps": 4, "BLOCK_M": 16}))
    assert set(done) == {ok_key, ("triton", dump_json({"BLOCK_M": 1024, "num_warps": 4}))}
    assert done[ok_key].median_us == 9.0  # the newest of the two measurements
    assert done[ok_key].status is MeasurementStatus.OK


def test_finish_run_accepts_a_run_from_an_earlier_session(tmp_path):
    path = tmp_path / "t.db"
    with open_table(path, writable=True) as table:
        with table.session() as s:
            run = start_run(s, get_or_create_sku(s, *H200), ENVIRONMENT, "tune", None, None)
        with table.session() as s:
            finish_run(s, run, "failed")
        with table.session() as s:
            stored = s.get(TuningRun, run.id)
            assert stored.status is RunStatus.FAILED and stored.finished_at >= stored.started_at


def test_foreign_keys_are_enforced(tmp_path):
    path = tmp_path / "t.db"
    with pytest.raises(TableError, match="FOREIGN KEY constraint failed"):
        with open_table(path, writable=True) as table, table.session() as s:
            bucket = get_or_create_bucket(s, **bucket_key())
            s.add(Measurement(
                run_id=999, bucket_id=bucket.id, kernel="k", params="{}", samples=1,
                status=MeasurementStatus.OK, created_at=datetime.datetime(2025, 1, 1),
            ))


def test_session_rolls_back_on_error_and_read_only_cannot_write(tmp_path):
    path = tmp_path / "t.db"
    tune(path)
    with pytest.raises(RuntimeError):
        with open_table(path, writable=True) as table, table.session() as s:
            get_or_create_bucket(s, **bucket_key(num_tokens=2))
            raise RuntimeError("tuner crashed")
    with pytest.raises(TableError, match="readonly"):
        with open_table(path) as table, table.session() as s:
            get_or_create_bucket(s, **bucket_key(num_tokens=4))
    assert [r["bucket"]["num_tokens"] for r in read_measurements(path)] == [64, 64]
    with open_table(path) as table, table.session() as s:
        assert s.scalar(select(func.count()).select_from(BucketRow)) == 1


def test_write_table_leaves_the_old_file_intact_when_the_body_raises(tmp_path):
    path = tmp_path / "h200.db"
    tune(path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="boom"):
        with write_table(path) as table, table.session() as s:
            sku, bucket = get_or_create_sku(s, *H200), get_or_create_bucket(s, **bucket_key())
            run = start_run(s, sku, ENVIRONMENT, "tune", None, None)
            set_winner(s, sku, bucket, run, "other", {}, 1.0, 1.0, 1.0, None, "rule", {}, 9.0)
            s.flush()
            raise RuntimeError("boom")
    assert path.read_bytes() == before
    assert files_in(tmp_path) == ["h200.db"]
    assert read_winners(path).rows[0].kernel == "triton"


def test_write_table_commits_on_success_only_when_the_block_ends(tmp_path):
    path = tmp_path / "h200.db"
    tune(path)
    os.chmod(path, 0o640)
    with write_table(path) as table:
        assert table.path != path and table.path.parent == tmp_path
        with table.session() as s:
            get_or_create_bucket(s, **bucket_key(num_tokens=2))
        assert len(read_measurements(path)) == 2  # readers still see the old file
        with open_table(path) as old, old.session() as s:
            assert s.scalar(select(func.count()).select_from(BucketRow)) == 1
    with open_table(path) as new, new.session() as s:
        assert s.scalar(select(func.count()).select_from(BucketRow)) == 2
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert files_in(tmp_path) == ["h200.db"]


def test_write_table_on_a_new_path_that_fails_creates_nothing(tmp_path):
    with pytest.raises(KeyError):
        with write_table(tmp_path / "new.db"):
            raise KeyError("x")
    assert files_in(tmp_path) == []


def test_unwritable_directory_is_refused_before_any_work(tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "t.db"
    with pytest.raises(TableError, match=f"{missing}: cannot write, directory .* does not exist"):
        with write_table(missing):
            pytest.fail("the body must not run")
    with pytest.raises(TableError, match=f"{missing}: cannot create the table"):
        open_table(missing, writable=True)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TableError, match=str(blocker / "t.db")):
        with write_table(blocker / "t.db"):
            pytest.fail("the body must not run")


def test_read_only_directory_is_refused(tmp_path):
    """A mode-0555 directory stops other users; /proc stops root too (CI runs as root)."""
    directory = tmp_path / "ro"
    directory.mkdir(mode=0o555)
    if os.geteuid() != 0:
        with pytest.raises(TableError, match="is not writable"):
            with write_table(directory / "t.db"):
                pytest.fail("the body must not run")
    for special in ("/proc", "/sys"):
        with pytest.raises(TableError, match=f"{special}/t.db: cannot write"):
            with write_table(Path(special) / "t.db"):
                pytest.fail("the body must not run")


def test_bad_params_json_row_is_skipped_into_bad_rows(tmp_path):
    path = tmp_path / "t.db"
    for n in (1, 2, 4):
        tune(path, num_tokens=n)
    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE winner SET params = '{not json' WHERE bucket_id = "
            "(SELECT id FROM bucket WHERE num_tokens = 2)"
        )
        conn.execute(
            "UPDATE winner SET baseline_params = '[1, 2]' WHERE bucket_id = "
            "(SELECT id FROM bucket WHERE num_tokens = 4)"
        )
    snapshot = read_winners(path)
    assert [r.bucket["num_tokens"] for r in snapshot.rows] == [1]
    assert len(snapshot.bad_rows) == 2
    assert "params are not a JSON object" in snapshot.bad_rows[0]
    assert "'num_tokens': 2" in snapshot.bad_rows[0]
    assert "'num_tokens': 4" in snapshot.bad_rows[1]


def test_params_must_be_plain_json(tmp_path):
    with open_table(tmp_path / "t.db", writable=True) as table, table.session() as s:
        sku, bucket = get_or_create_sku(s, *H200), get_or_create_bucket(s, **bucket_key())
        run = start_run(s, sku, ENVIRONMENT, "tune", None, None)
        with pytest.raises(TypeError):
            add_measurement(s, run, bucket, "k", {"f": object()}, 1.0, 1.0, 1.0, 1, 0.0, "ok")
        with pytest.raises(ValueError):
            add_measurement(s, run, bucket, "k", {"x": float("nan")}, 1.0, 1.0, 1.0, 1, 0.0, "ok")
        with pytest.raises(ValueError, match="needs median_us"):
            add_measurement(s, run, bucket, "k", {}, None, None, None, 0, None, "ok")
        assert s.scalar(select(func.count()).select_from(Measurement)) == 0


def test_newest_run_with_winners_supplies_the_environment(tmp_path):
    path = tmp_path / "t.db"
    tune(path)
    before = read_winners(path).environment
    with open_table(path, writable=True) as table, table.session() as s:
        sku = get_or_create_sku(s, *H200)
        newer = start_run(s, sku, {**ENVIRONMENT, "torch": "2.10.0"}, "tune", None, None)
        finish_run(s, newer, RunStatus.FINISHED)  # finished, but measured no winner
    assert read_winners(path).environment == before
    with open_table(path, writable=True) as table, table.session() as s:
        sku = get_or_create_sku(s, *H200)
        killed = start_run(s, sku, {**ENVIRONMENT, "torch": "2.11.0"}, "tune", None, None)
        bucket = get_or_create_bucket(s, **bucket_key())
        set_winner(s, sku, bucket, killed, "k", {}, 1.0, 1.0, 1.0, 0.0, "b", {}, 2.0)
    assert read_winners(path).environment["torch"] == "2.11.0"  # never finished, still counts


def test_memory_bytes_beyond_32_bits_survives(tmp_path: Path):
    path = tmp_path / "t.db"
    tune(path, sku=MI300X)
    assert read_winners(path).skus[0]["memory_bytes"] == MI300X[4] > 2**32


def test_paths_with_uri_and_config_special_characters(tmp_path):
    directory = tmp_path / "odd #1 %20 ?x"
    directory.mkdir()
    path = directory / "t 100%.db"
    tune(path)
    assert read_winners(path).rows[0].kernel == "triton"
    assert len(read_measurements(path)) == 2
