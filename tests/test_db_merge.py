"""``export_sqlite`` and ``merge_tables`` on real table files."""

import os
import sqlite3

import pytest
from sqlalchemy import func, select

from moetune.db import (
    HEAD_REVISION,
    BaselineRecord,
    Candidate,
    Measurement,
    SkuRow,
    TuningRun,
    dump_baselines,
    export_sqlite,
    merge_tables,
    open_table,
    read_measurements,
    read_winners,
    schema_revision,
)
from moetune.errors import TableError

from .test_db_helpers import MI300X, files_in, tune


def _count(path, model):
    with open_table(path) as table, table.session() as s:
        return s.scalar(select(func.count()).select_from(model))


def _winners(path):
    return {(r.sku["name"], r.bucket["num_tokens"]): (r.kernel, r.median_us)
            for r in read_winners(path).rows}


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "src.db"
    tune(path, num_tokens=1, median=5.0)
    tune(path, num_tokens=64, kernel="grouped_mm", params={"tile": 128}, median=20.0)
    tune(path, sku=MI300X, num_tokens=64, kernel="aiter", params={}, median=15.0)
    return path


@pytest.mark.parametrize("with_measurements", [False, True])
def test_export_writes_a_self_contained_table(tmp_path, table, with_measurements):
    out = tmp_path / "artifact.db"
    out_before = tmp_path / "stale.db"
    tune(out_before, num_tokens=4096, kernel="stale")  # an existing artifact is rebuilt, not merged
    os.replace(out_before, out)
    export_sqlite(table, out, include_measurements=with_measurements)
    assert schema_revision(out) == HEAD_REVISION
    assert read_winners(out).rows == read_winners(table).rows
    assert read_winners(out).skus == read_winners(table).skus
    assert _count(out, TuningRun) == 3
    assert _count(out, Measurement) == (6 if with_measurements else 0)
    if with_measurements:
        assert read_measurements(out) == read_measurements(table)
    assert files_in(tmp_path) == ["artifact.db", "src.db"]


def test_export_refuses_to_overwrite_a_file_that_is_not_a_table(tmp_path, table):
    out = tmp_path / "notes.txt"
    out.write_text("precious")
    with pytest.raises(TableError, match="not a moetune table"):
        export_sqlite(table, out)
    assert out.read_text() == "precious"


def test_merge_takes_the_union(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    tune(a, num_tokens=1)
    tune(b, num_tokens=64, sku=MI300X)
    report = merge_tables(a, b, out, check=None)
    assert (report.rows, report.from_a, report.from_b, report.conflicts) == (2, 1, 1, [])
    assert _winners(out) == {("H200", 1): ("triton", 10.0), ("MI300X", 64): ("triton", 10.0)}
    assert _count(out, SkuRow) == 2 and _count(out, TuningRun) == 2
    assert _count(out, Measurement) == 4
    assert {r["run_id"] for r in read_measurements(out)} == {1, 2}


def test_merge_faster_median_wins_when_times_differ_beyond_their_spread(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    # Timed against different rule picks (vLLM's tuned file changed): no common ratio.
    tune(a, kernel="fast_old", median=10.0, spread=0.5, rule_params={"BLOCK_SIZE_M": 16})
    tune(b, kernel="slow_new", median=12.0, spread=0.5)  # newer run, clearly slower
    report = merge_tables(a, b, out, check=None)
    [conflict] = report.conflicts
    assert (conflict.kernel_a, conflict.kernel_b, conflict.median_us_a, conflict.median_us_b) == (
        "fast_old", "slow_new", 10.0, 12.0)
    assert (conflict.winner, conflict.reason) == ("a", "faster median")
    assert conflict.bucket["num_tokens"] == 64 and conflict.sku["name"] == "H200"
    assert _winners(out) == {("H200", 64): ("fast_old", 10.0)}
    assert "fast_old" in str(conflict) and "-> a" in str(conflict)


def test_merge_newer_run_wins_a_statistical_tie_even_when_slightly_slower(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    tune(b, kernel="old", median=10.0, spread=1.0)  # b is measured first: the older run
    tune(a, kernel="new", median=10.5, spread=1.0)
    report = merge_tables(a, b, out, check=None)
    [conflict] = report.conflicts
    assert conflict.winner == "a" and conflict.reason.startswith("newer run")
    assert _winners(out) == {("H200", 64): ("new", 10.5)}
    # The same tie with the sides swapped still picks the newer run: the rule is symmetric.
    assert merge_tables(b, a, out, check=None).conflicts[0].winner == "b"
    assert _winners(out) == {("H200", 64): ("new", 10.5)}


def test_merge_higher_speedup_over_the_same_rule_wins_over_a_faster_median(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    # b ran on a slower day: its median is slower, but it beat the same rule pick by more.
    tune(a, kernel="fast_day", median=10.0, spread=0.5, baseline=11.0)  # 1.10x
    tune(b, kernel="better", median=12.0, spread=0.5, baseline=18.0)  # 1.50x
    [conflict] = merge_tables(a, b, out, check=None).conflicts
    assert (conflict.winner, conflict.reason) == ("b", "higher speedup over the same rule pick")
    assert _winners(out) == {("H200", 64): ("better", 12.0)}
    assert merge_tables(b, a, out, check=None).conflicts[0].winner == "a"  # symmetric
    assert _winners(out) == {("H200", 64): ("better", 12.0)}


def test_speedups_over_different_vllms_picks_are_not_compared(tmp_path):
    """The same kernel and config as two vLLM releases' picks is two baselines: a speedup over
    vLLM 0.32's says nothing against one over 0.34's, so the medians decide."""
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    tune(a, kernel="fast_day", median=10.0, spread=0.5, baseline=11.0)  # 1.10x
    tune(b, kernel="better", median=12.0, spread=0.5, baseline=18.0)  # 1.50x
    for path, us, vllm in ((a, 11.0, "0.34.0"), (b, 18.0, "0.32.0")):
        text = dump_baselines([BaselineRecord(Candidate("rule", {}), vllm, median_us=us,
                                              beaten=True)])
        with sqlite3.connect(path) as con:
            con.execute("UPDATE winner SET baselines = ?", (text,))
    [conflict] = merge_tables(a, b, out, check=None).conflicts
    assert (conflict.winner, conflict.reason) == ("a", "faster median")


def test_merge_speedups_within_each_others_spread_are_a_tie_the_newer_run_wins(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    # Medians apart (a slower day), speedups 1.50x and 1.47x: each within the range the other's
    # p20-p80 implies (1.46-1.55x and 1.43-1.51x), so the older row's higher ratio is noise.
    tune(a, kernel="old_quiet_day", median=10.0, spread=0.3, baseline=15.0)
    tune(b, kernel="new", median=11.0, spread=0.3, baseline=16.2)
    [conflict] = merge_tables(a, b, out, check=None).conflicts
    assert (conflict.winner, conflict.reason) == (
        "b", "newer run; speedups within each other's p20-p80 spread")
    assert _winners(out) == {("H200", 64): ("new", 11.0)}
    assert merge_tables(b, a, out, check=None).conflicts[0].winner == "a"  # symmetric
    # Beyond the spread (the newer run 1.40x, whose range 1.36-1.45x misses 1.50x) the ratio decides.
    tune(b, kernel="new", median=11.0, spread=0.3, baseline=15.4)
    [conflict] = merge_tables(a, b, out, check=None).conflicts
    assert (conflict.winner, conflict.reason) == ("a", "higher speedup over the same rule pick")


def test_merge_spread_must_contain_both_medians(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    tune(a, kernel="old_wide", median=10.0, spread=3.0,  # 12 lies within a's spread...
         rule_params={"BLOCK_SIZE_M": 16})
    tune(b, kernel="new_tight", median=12.0, spread=0.5)  # ...but 10 not within b's
    assert merge_tables(a, b, out, check=None).conflicts[0].reason == "faster median"
    assert _winners(out) == {("H200", 64): ("old_wide", 10.0)}


def test_merge_into_its_first_input_is_atomic_and_idempotent(tmp_path, table):
    other = tmp_path / "other.db"
    tune(other, num_tokens=2)
    report = merge_tables(table, other, table, check=None, update_a=True)
    assert (report.rows, report.from_a, report.from_b) == (4, 3, 1)
    assert _count(table, TuningRun) == 4 and _count(table, Measurement) == 8
    again = merge_tables(table, other, table, check=None, update_a=True)  # nothing new: no duplicate runs or trials
    assert (again.rows, again.conflicts) == (4, [])
    assert _count(table, TuningRun) == 4 and _count(table, Measurement) == 8
    assert files_in(tmp_path) == ["other.db", "src.db"]


def test_merge_of_a_bad_input_leaves_out_untouched(tmp_path, table):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"garbage")
    before = table.read_bytes()
    with pytest.raises(TableError, match="bad.db: not a moetune table"):
        merge_tables(table, bad, table, check=None, update_a=True)
    assert table.read_bytes() == before


def _imported(path, kernel, median, source):
    """One import run whose row has no baseline time (and, from vLLM files, no time)."""
    from moetune.db import (RunStatus, finish_run, get_or_create_bucket, get_or_create_sku,
                            set_winner, start_run, write_table)

    from .test_db_helpers import ENVIRONMENT, H200, bucket_key

    with write_table(path) as table, table.session() as session:
        sku_row = get_or_create_sku(session, *H200)
        bucket = get_or_create_bucket(session, **bucket_key(num_tokens=64))
        run = start_run(session, sku_row, ENVIRONMENT, "moetune import", None, None)
        set_winner(session, sku_row, bucket, run, kernel, {}, median, median, median, None,
                   kernel, {}, None, source=source)
        finish_run(session, run, RunStatus.FINISHED)


@pytest.mark.parametrize("imported_us,source", [(None, "vllm-json"), (1.0, "aiter-csv")])
def test_merge_measured_beats_imported_even_faster_imported(tmp_path, imported_us, source):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    tune(a, kernel="measured", median=10.0)
    _imported(b, "imported", imported_us, source)  # newer, and (aiter) "faster" elsewhere
    [conflict] = merge_tables(a, b, out, check=None).conflicts
    assert (conflict.winner, conflict.reason) == ("a", "measured here beats imported")
    assert _winners(out) == {("H200", 64): ("measured", 10.0)}
    assert "no time" in str(conflict) or imported_us is not None


def test_merge_of_two_imports_without_times_keeps_the_newer(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    _imported(a, "older", None, "vllm-json")
    _imported(b, "newer", None, "vllm-json")
    [conflict] = merge_tables(a, b, out, check=None).conflicts
    assert conflict.winner == "b" and _winners(out) == {("H200", 64): ("newer", None)}


def test_a_winner_needs_a_known_source_and_a_measured_one_its_times(tmp_path):
    with pytest.raises(ValueError, match="source 'guess'"):
        _imported(tmp_path / "a.db", "k", None, "guess")
    from moetune.db import set_winner
    with pytest.raises(ValueError, match="median_us must be a positive finite time"):
        set_winner(None, None, None, None, "k", {}, None, None, None, 1e-3, "rule", {}, 10.0)
    assert not (tmp_path / "a.db").exists()  # the failed write left nothing behind


# --- invalid winners ----------------------------------------------------------------------------
def _edit(path, num_tokens, assignment):
    """Break one winner in place, as a hand edit or a bug elsewhere would."""
    with sqlite3.connect(path) as con:
        con.execute(f"UPDATE winner SET {assignment} WHERE bucket_id = "
                    "(SELECT id FROM bucket WHERE num_tokens = ?)", (num_tokens,))


def _gone(row):
    """A stand-in for the runtime's row check: refuses kernel ``gone`` with a reason."""
    return "unknown kernel 'gone'" if row.kernel == "gone" else None


def test_merge_drops_unreadable_winners_and_reports_each(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    for m in (1, 2, 4):
        tune(a, num_tokens=m)
    tune(b, num_tokens=8)
    _edit(a, 2, "params = '{not json'")
    _edit(a, 4, "baselines = '[1'")
    report = merge_tables(a, b, out, check=None)
    assert (report.rows, report.from_a, report.from_b) == (2, 1, 1)
    assert sorted(_winners(out)) == [("H200", 1), ("H200", 8)]
    first, second = report.dropped
    assert (first.table, first.bucket["num_tokens"], second.bucket["num_tokens"]) == (str(a), 2, 4)
    assert first.reason.startswith("params are not a JSON object")
    assert second.reason.startswith("baselines are not a JSON list of objects")
    assert str(first).startswith("H200 num_tokens=2 hidden_size=4096 ")
    assert f"from {a}: params are not a JSON object" in str(first)


def test_merge_drops_what_the_check_refuses_so_it_never_wins_a_bucket(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    tune(a, kernel="gone", median=1.0, spread=0.5)  # far faster, but invalid
    tune(a, num_tokens=1, kernel="kept")
    tune(b, kernel="valid", median=50.0)
    report = merge_tables(a, b, out, check=_gone)
    assert _winners(out) == {("H200", 64): ("valid", 50.0), ("H200", 1): ("kept", 10.0)}
    assert report.conflicts == []  # the invalid row took no part in choosing
    [dropped] = report.dropped
    assert (dropped.table, dropped.reason) == (str(a), "unknown kernel 'gone'")
    assert _count(out, Measurement) == 6  # provenance and trials are still kept
    unchecked = merge_tables(a, b, tmp_path / "unchecked.db", check=None)
    assert _winners(unchecked.output)[("H200", 64)] == ("gone", 1.0)  # the check decides


def test_strict_merge_and_a_merge_of_only_invalid_rows_write_nothing(tmp_path, table):
    other = tmp_path / "other.db"
    tune(other, num_tokens=2, kernel="gone")
    before = table.read_bytes()
    with pytest.raises(TableError, match="not written, invalid winners:\n  H200 num_tokens=2 "
                                         ".* from .*other.db: unknown kernel 'gone'"):
        merge_tables(table, other, table, check=_gone, strict=True, update_a=True)
    assert table.read_bytes() == before
    with pytest.raises(TableError, match="not written, every winner is invalid"):
        merge_tables(other, None, tmp_path / "out.db", check=_gone)
    assert files_in(tmp_path) == ["other.db", "src.db"]
    assert merge_tables(table, other, table, check=_gone, update_a=True).rows == 3  # not strict: dropped


@pytest.mark.parametrize("with_measurements", [False, True])
def test_copying_one_table_keeps_its_valid_winners_only(tmp_path, table, with_measurements):
    _edit(table, 1, "kernel = 'gone'")
    out = tmp_path / "artifact.db"
    report = merge_tables(table, None, out, check=_gone, include_measurements=with_measurements)
    assert (report.rows, report.from_a, report.from_b, report.conflicts) == (2, 2, 0, [])
    assert [d.reason for d in report.dropped] == ["unknown kernel 'gone'"]
    assert _winners(out) == {("H200", 64): ("grouped_mm", 20.0), ("MI300X", 64): ("aiter", 15.0)}
    assert _count(out, TuningRun) == 3
    assert _count(out, Measurement) == (6 if with_measurements else 0)
