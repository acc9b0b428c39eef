"""Tables in a real PostgreSQL server: the migrations, jobs on several hosts writing one database
at once, Optuna's storage there, exporting the SQLite file that ships, and clear errors."""

from __future__ import annotations

import multiprocessing as mp

import optuna
import pytest
from alembic import command
from typer.testing import CliRunner

from moetune import db
from moetune.errors import TableError
from moetune.runtime.dispatcher import Dispatcher
from moetune.runtime.platform import detect_sku
from moetune.runtime.problem import MoEProblem
from moetune.cli import app
from moetune.tuner.job import JobOptions, run_job
from tests import postgres

SHAPE = dict(hidden_size=64, intermediate_size=96, num_experts=8, topk=2, dtype="float32")


@pytest.fixture(scope="module")
def new_database():
    yield from postgres.server()


def test_migrations_build_the_models_schema_on_postgresql(new_database):
    url = new_database("migrated")
    command.upgrade(db.alembic_config(url), "head")  # the migration scripts, not create_all
    command.check(db.alembic_config(url))  # raises if the migrated schema drifts from the models
    with db.open_table(url) as table:
        assert table.revision == db.HEAD_REVISION and not table.writable


def test_an_empty_database_is_created_on_write_and_refused_on_read(new_database):
    url = new_database("empty")
    with pytest.raises(TableError, match="no moetune table in this database"):
        db.open_table(url)
    with db.open_table(url, writable=True) as table:
        assert table.revision == db.HEAD_REVISION
    assert db.read_winners(url).rows == []


def _tune(url: str, buckets: tuple[int, ...]) -> list[str | None]:
    problems = [MoEProblem(m, **SHAPE) for m in buckets]
    outcomes = run_job(problems, url, detect_sku("cpu"), JobOptions(device="cpu", trials=3, reps=2))
    return [o.error for o in outcomes]


def test_jobs_on_two_hosts_tune_into_one_database_at_once(new_database):
    """Two jobs start together on one fresh database (both create the schema, the SKU and the
    shared bucket): every bucket is published once, both runs finish, nothing is duplicated."""
    url = new_database("shared")
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        errors = pool.starmap(_tune, [(url, (1, 8)), (url, (8, 16))])
    assert errors == [[None, None], [None, None]]
    snapshot = db.read_winners(url)
    assert sorted(r.bucket["num_tokens"] for r in snapshot.rows) == [1, 8, 16]
    assert len(snapshot.skus) == 1
    with db.open_table(url) as table, table.session() as s:
        runs = s.query(db.TuningRun).all()
        assert [r.status for r in runs] == [db.RunStatus.FINISHED] * 2
        assert s.query(db.BucketRow).count() == 3


def test_a_server_table_exports_the_file_that_ships(new_database, tmp_path, cpu_sku):
    url = new_database("export")
    assert _tune(url, (1, 32)) == [None, None]
    artifact = tmp_path / "cpu.db"
    db.export_sqlite(url, artifact)
    dispatcher = Dispatcher.load(artifact, cpu_sku)
    assert dispatcher.status.usable and dispatcher.status.rows == 2
    assert dispatcher.select(MoEProblem(30, **SHAPE)).source == "table"
    shown = CliRunner().invoke(app, ["show", url, "--json"])
    assert shown.exit_code == 0 and shown.output.count("\n") == 2
    with pytest.raises(TableError, match="write a table file, not a database"):
        db.export_sqlite(artifact, url)


def test_optuna_studies_live_in_their_own_postgresql_database(new_database, tmp_path, cpu_sku):
    """Optuna's storage is a URL too; it keeps its own alembic_version, so it needs its own
    database, and moetune refuses to take that database for a table."""
    studies = new_database("optuna")
    outcomes = run_job([MoEProblem(4, **SHAPE)], tmp_path / "t.db", cpu_sku,
                       JobOptions(device="cpu", trials=3, reps=2, optuna_storage=studies))
    assert outcomes[0].error is None
    (summary,) = optuna.get_all_study_summaries(storage=studies)
    assert summary.study_name.startswith("moetune:M=4 ") and summary.n_trials >= 3
    with pytest.raises(TableError, match="not a moetune table"):
        db.open_table(studies, writable=True)


@pytest.mark.parametrize("url,why", [
    ("postgresql+psycopg://postgres@127.0.0.1:1/none", "Connection refused|connection failed"),
    ("nosuchdb://somewhere/x", "cannot open"),
])
def test_a_database_that_cannot_be_used_is_one_clear_error(url, why):
    with pytest.raises(TableError, match=why):
        db.read_winners(url)
    result = CliRunner().invoke(app, ["show", url])
    assert result.exit_code == 1 and result.output.startswith("error:")


def test_a_row_another_job_inserted_first_is_reused_not_duplicated(new_database):
    """Job B looks for the bucket, finds none, inserts it while job A's insert of the same
    bucket is uncommitted: B waits on the unique key, then takes A's row."""
    import threading

    url = new_database("race")
    key = MoEProblem(8, **SHAPE).to_row()
    with db.open_table(url, writable=True) as a_table, db.open_table(url, writable=True) as b_table:
        with a_table.session() as a:
            a_id = db.get_or_create_bucket(a, **key).id
            b_ids: list[int] = []
            with b_table.session() as b:
                b.query(db.BucketRow).all()  # B's snapshot: no bucket yet
                thread = threading.Thread(
                    target=lambda: b_ids.append(db.get_or_create_bucket(b, **key).id))
                thread.start()
                thread.join(timeout=1.0)
                assert thread.is_alive()  # blocked on A's uncommitted insert
                a.commit()
                thread.join(timeout=30)
        assert b_ids == [a_id]


def test_database_passwords_stay_out_of_the_table(new_database, monkeypatch):
    url = new_database("secret").replace("postgres@", "postgres:hunter2@")  # trust: not checked
    monkeypatch.setattr("sys.argv", ["moetune", "tune", "--output", url, "--trials", "3"])
    assert _tune(url, (2,)) == [None]
    with db.open_table(url) as table, table.session() as s:
        (command,) = [r.command for r in s.query(db.TuningRun)]
    assert "hunter2" not in command and "postgres:***@" in command


def test_a_bucket_another_job_is_tuning_is_left_to_it(new_database, cpu_sku):
    """Jobs on several hosts can all be given every bucket: each tunes the ones nobody holds."""
    from moetune.tuner.bucket import claim_bucket

    url = new_database("claims")
    one, eight = (MoEProblem(m, **SHAPE) for m in (1, 8))
    opts = JobOptions(device="cpu", trials=3, reps=2)
    with claim_bucket(db.TableWriter(url), cpu_sku, eight) as held:  # another job tunes 8
        assert held
        first = run_job([one, eight], url, cpu_sku, opts)
    assert first[0].decision is not None and first[1].skipped == "another job is tuning it"
    assert [r.bucket["num_tokens"] for r in db.read_winners(url).rows] == [1]
    second = run_job([eight], url, cpu_sku, opts)  # the claim is gone with its holder
    assert second[0].skipped is None and second[0].decision is not None
    assert sorted(r.bucket["num_tokens"] for r in db.read_winners(url).rows) == [1, 8]
