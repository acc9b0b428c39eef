"""Judging a table a shape at a time: a shape's rows are read and judged only when it is asked
for, and every answer is the one judging the whole table at load gave."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import sqlite3
import threading
from pathlib import Path

import pytest

from moetune.db import WinnerReader, read_winners
from moetune.errors import TableError
from moetune.runtime import _table_rows
from moetune.runtime.dispatcher import Dispatcher, row_verdict
from moetune.runtime.kernels.base import WeightLayout
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem, Shape, bucket_text
from moetune.runtime.rules import rule_choice
from moetune.serving.settings import Mode, Settings
from moetune.serving.state import PluginState
from tests.vllm_tables import write_winners

H200 = SKU(Vendor.NVIDIA, "H200", "sm_90", 132, 141 << 30)


def _shape(hidden: int, **kw) -> Shape:
    return MoEProblem(1, hidden, 32, 4, 2, dtype="float32", **kw).shape


GOOD, RULE, GONE, BAD_JSON, BAD_BASELINES, STALE, CASED, GATED2, TOPK, TOKENS = (
    _shape(64 + 16 * i) for i in range(10))
#: Every shape with rows in ``table``; the bucket ids of the ones edited by hand follow from
#: the order they are written in.
SHAPES = (GOOD, RULE, GONE, BAD_JSON, BAD_BASELINES, STALE, CASED, GATED2, TOPK, TOKENS)
PROBE = (1, 3, 4, 6, 16, 100, 5000)


def _edit(con: sqlite3.Connection, shape: Shape, sql: str, *args: object) -> None:
    """Run ``sql`` (an UPDATE ... WHERE) for the rows of ``shape``'s buckets."""
    buckets = f"SELECT id FROM bucket WHERE hidden_size = {shape.hidden_size}"
    con.execute(sql.format(buckets=buckets), args)


@pytest.fixture(scope="module")
def table(tmp_path_factory, cpu_sku) -> Path:
    """Served, rule-pick, faulty (unknown kernel, unreadable params, unreadable baselines, a
    bucket that is no problem), stale and hand-spelled rows over ten shapes, and unreadable
    rows for another SKU."""
    path = tmp_path_factory.mktemp("lazy") / "t.db"
    for shape in SHAPES:
        rule = rule_choice(shape.problem(1), cpu_sku)
        kernel, params = (rule.kernel, rule.params) if shape is RULE else ("torch_grouped", {})
        write_winners(path, shape, (1, 4, 16), kernel, params, sku=cpu_sku)
    write_winners(path, GOOD, (1, 2), "torch_grouped", sku=H200)
    with sqlite3.connect(path) as con:
        _edit(con, GONE, "UPDATE winner SET kernel = 'gone_kernel' WHERE bucket_id IN "
                         "({buckets}) AND bucket_id = (SELECT max(id) FROM ({buckets}))")
        _edit(con, BAD_JSON, "UPDATE winner SET params = '{{not json' WHERE bucket_id IN "
                             "({buckets}) AND bucket_id = (SELECT min(id) FROM ({buckets}))")
        _edit(con, BAD_BASELINES, "UPDATE winner SET baselines = '[1, 2]' WHERE bucket_id IN "
                                  "({buckets})")
        _edit(con, STALE, "UPDATE winner SET baselines = ? WHERE bucket_id IN ({buckets})",
              json.dumps({"variants": []}))
        _edit(con, CASED, "UPDATE bucket SET dtype = 'Float32' WHERE id IN ({buckets})")
        _edit(con, GATED2, "UPDATE bucket SET gated = 2 WHERE id IN ({buckets})")
        _edit(con, TOPK, "UPDATE bucket SET topk = 9 WHERE id IN ({buckets})")
        _edit(con, TOKENS, "UPDATE bucket SET num_tokens = 0 WHERE id IN ({buckets}) AND "
                           "num_tokens = 4")
        con.execute("UPDATE winner SET params = 'junk' WHERE sku_id = 2")
    return path


def _eager(path: Path, sku: SKU) -> dict[str, object]:
    """What ``Dispatcher.load`` found when it judged every row at load (the old load)."""
    snapshot = read_winners(path)
    served: dict[Shape, dict[int, object]] = {}
    faults: dict[Shape, dict[int, str]] = {}
    rejected, faulty = [], []

    def fault(bucket: dict, problem: MoEProblem | None, why: str) -> None:
        faulty.append(f"bucket {bucket_text(bucket)}: {why}")
        if problem is not None:
            faults.setdefault(problem.shape, {})[problem.num_tokens] = why

    for r in snapshot.rows:
        v = row_verdict(r, sku)
        if v.other_sku:
            continue
        if v.selection is not None:
            served.setdefault(v.problem.shape, {})[v.problem.num_tokens] = v.selection
            continue
        rejected.append(f"bucket {bucket_text(r.bucket)}: {v.reason}")
        if not v.stale:
            fault(r.bucket, v.problem, v.reason)
    for row_sku, bucket, why in snapshot.bad_winners:
        if (row_sku["vendor"], row_sku["name"], row_sku["arch"]) == (sku.vendor.value, sku.name,
                                                                      sku.arch):
            try:
                problem = MoEProblem.from_row(bucket)
            except Exception:
                problem = None
            fault(bucket, problem, why)
    return {"served": served, "faults": faults, "rejected": (*rejected, *snapshot.bad_rows),
            "faulty": tuple(faulty)}


@pytest.mark.parametrize("status_first", [False, True])
def test_every_answer_is_the_one_judging_the_whole_table_gives(table, cpu_sku, status_first):
    eager = _eager(table, cpu_sku)
    assert set(eager["served"]) == {GOOD, RULE, GONE, BAD_JSON, CASED, GATED2, TOKENS}
    assert set(eager["faults"]) == {GONE, BAD_JSON, BAD_BASELINES}
    d = Dispatcher.load(table, cpu_sku)
    if status_first:
        d.status
    for shape in SHAPES:
        served = eager["served"].get(shape, {})
        assert d.buckets(shape) == tuple(sorted(served)), shape
        assert d.covers(shape) is bool(served)
        assert d.faults(shape) == eager["faults"].get(shape, {})
        # Buckets that make no valid problem (num_tokens 0, topk 9) belong to no shape.
        assert d.faulty_rows(shape) == tuple(line for line in eager["faulty"]
                                             if f" H={shape.hidden_size} " in line)
        for m in PROBE:
            pick = d.select(shape.problem(m))
            if served:
                assert dataclasses.replace(pick, rule_pick=False) == served[pick.bucket]
            else:
                assert pick.source == "rule"
    assert d.select(RULE.problem(4)).rule_pick
    assert "not served here" in d.select(STALE.problem(4)).reason
    assert d.status.rows == sum(map(len, eager["served"].values()))
    assert d.status.reason == f"{d.status.rows} rows for {cpu_sku.label()}"
    assert d.status.rejected_rows == eager["rejected"]
    assert d.status.faulty_rows == eager["faulty"]
    assert any("'num_tokens': 2" in r for r in d.status.rejected_rows)  # the other SKU's
    assert d.shapes() == tuple(eager["served"])


def _count_verdicts(monkeypatch) -> list[Shape]:
    """The shape of each row judged from now on."""
    judged: list[Shape] = []

    def counting(row, sku, registry, environment):
        judged.append(_shape(row.bucket["hidden_size"]))
        return row_verdict(row, sku, registry, environment)

    monkeypatch.setattr(_table_rows, "row_verdict", counting)
    return judged


def test_a_shapes_rows_are_read_and_judged_when_it_is_first_asked_for(table, cpu_sku,
                                                                       monkeypatch):
    import moetune.db._read as read_module
    import moetune.db._rowcheck as rowcheck_module

    judged = _count_verdicts(monkeypatch)
    parsed: list[str] = []
    for module in (read_module, rowcheck_module):  # params and environments; baselines
        monkeypatch.setattr(module, "load_json",
                            lambda text, load=module.load_json: parsed.append(text) or load(text))
    d = Dispatcher.load(table, cpu_sku)
    assert judged == [] and len(parsed) == 1 and '"torch"' in parsed[0]  # the environment
    assert d.usable and d.table_rows == 3 * len(SHAPES)
    d.select(GOOD.problem(4))
    assert judged == [GOOD] * 3 and len(parsed) > 1 and not any("variants" in t for t in parsed)
    d.buckets(STALE)
    assert any("variants" in t for t in parsed)
    d.covers(GOOD), d.faults(GOOD), d.select(GOOD.problem(16))
    assert judged == [GOOD] * 3 + [STALE] * 3  # judged once
    d.faults(_shape(4096))  # a shape without rows reads nothing
    assert len(judged) == 6
    d.status
    # then every row (2 for another SKU), less the 6 unreadable ones
    assert len(judged) == 6 + 3 * len(SHAPES) + 2 - 6


def test_a_faulty_row_of_a_shape_never_asked_for_is_reported_and_refused_by_strict(
        table, cpu_sku):
    d = Dispatcher.load(table, cpu_sku)
    d.select(GOOD.problem(1))
    assert any("unknown kernel 'gone_kernel'" in r for r in d.status.faulty_rows)
    with pytest.raises(TableError, match="faulty rows.*gone_kernel"):
        PluginState(Settings(mode=Mode.STRICT, table=table)).dispatcher()


def test_vllm_startup_judges_no_row_and_warns_about_a_shapes_faults_when_it_attaches(
        table, monkeypatch, caplog):
    judged = _count_verdicts(monkeypatch)
    caplog.set_level(logging.INFO, logger="moetune")
    state = PluginState(Settings(table=table))
    state.dispatcher()
    (line,) = [r.getMessage() for r in caplog.records if "moetune: mode" in r.getMessage()]
    assert judged == [] and f"{3 * len(SHAPES)} rows, SKU" in line
    state.plan(GOOD, WeightLayout.PLAIN)
    state.plan(GONE, WeightLayout.PLAIN)
    state.plan(GONE, WeightLayout.AITER_SHUFFLED)  # another layout: no second warning
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "gone_kernel" in warnings[0]
    assert set(judged) == {GOOD, GONE}


def test_threads_asking_at_once_judge_each_shape_once(table, cpu_sku, monkeypatch):
    judged = _count_verdicts(monkeypatch)
    d = Dispatcher.load(table, cpu_sku)
    barrier = threading.Barrier(8)
    answers: list[tuple[int, ...]] = []

    def ask(shape: Shape) -> None:
        barrier.wait()
        answers.append(d.buckets(shape))

    threads = [threading.Thread(target=ask, args=(s,)) for s in (GOOD, STALE) * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(judged, key=SHAPES.index) == [GOOD] * 3 + [STALE] * 3
    assert sorted(answers) == [()] * 4 + [(1, 4, 16)] * 4


def test_a_table_that_cannot_be_read_after_load_falls_back_and_is_not_used(table, cpu_sku,
                                                                            monkeypatch):
    d = Dispatcher.load(table, cpu_sku)

    def damaged(*args, **kwargs):
        raise TableError(f"{table}: database disk image is malformed")

    monkeypatch.setattr(WinnerReader, "read", damaged)
    pick = d.select(GOOD.problem(4))
    assert pick.source == "rule" and "cannot be read: " in pick.reason
    assert not d.status.usable and "malformed" in d.status.reason
    assert d.select(RULE.problem(4)).source == "rule" and not d.covers(STALE)


def test_an_older_schema_is_judged_whole_at_load(tmp_path, monkeypatch):
    """Its upgraded copy lives in memory on one connection, which other threads cannot use."""
    path = tmp_path / "old.db"
    path.write_bytes((Path(__file__).parent / "assets" / "table_0001_initial.db").read_bytes())
    judged = _count_verdicts(monkeypatch)
    d = Dispatcher.load(path, H200, check_environment=False)
    assert d.usable and d.table_rows == 2 and len(judged) == 3  # and the MI300X row
    assert len(d.status.rejected_rows) == 2 and len(judged) == 3  # nothing read again


def test_a_forked_child_reads_the_table_on_its_own_connection(table):
    """A SQLite connection must not cross a fork: the child opens its own."""
    here = ("cpu",) + tuple(read_winners(table).skus[0][k] for k in ("name", "arch"))
    with WinnerReader(table) as reader:
        (key, _), *_ = reader.shapes(here)
        before = reader.read(here, [key]).rows
        out, into = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery, exit straight away
            try:
                os.write(into, pickle.dumps(reader.read(here, [key]).rows))
            finally:
                os._exit(0)
        os.close(into)
        with os.fdopen(out, "rb") as pipe:
            in_child = pickle.loads(pipe.read())
        os.waitpid(pid, 0)
        assert in_child == before and len(before) == 3
        assert reader.read(here, [key]).rows == before  # the parent's connection still works
