"""Several processes writing one table file: real ``moetune tune`` jobs, real SQLite, real kills."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from moetune.db import RunStatus, claim_in, write_table
from moetune.errors import TableLockError
from moetune.tuner.job import JobOptions, run_job
from moetune.tuner.presets import preset

MOETUNE = Path(sys.executable).with_name("moetune")
FAST = ["--preset", "tiny", "--device", "cpu", "--trials", "2", "--reps", "2"]
OUTCOME = re.compile(r"^M=(\d+)\s+(?:skipped: (.*)|.*; (\d+) measured, (\d+) reused)")


def _tune(path: Path, buckets: list[int]) -> subprocess.Popen[str]:
    assert MOETUNE.exists(), f"{MOETUNE}: the console script is missing (pip install -e .)"
    return subprocess.Popen(
        [str(MOETUNE), "tune", *FAST, "--buckets", ",".join(map(str, buckets)),
         "--output", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})  # two jobs share the cores


def _outcomes(job: subprocess.Popen[str]) -> dict[int, tuple[str | None, int]]:
    """Wait for a job; per bucket, why it was skipped (or None) and how many trials it measured."""
    stdout, stderr = job.communicate(timeout=600)
    assert job.returncode == 0, stdout + stderr
    found = {}
    for line in stdout.splitlines():
        if m := OUTCOME.match(line):
            found[int(m[1])] = (m[2], int(m[3] or 0))
    return found


def _query(path: Path, sql: str, *args: object) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return conn.execute(sql, args).fetchall()


def _runs(path: Path) -> dict[int, tuple[int, str]]:
    """pid -> (run id, status) of every run in the table."""
    return {pid: (run, status) for run, pid, status in
            _query(path, "SELECT id, pid, status FROM tuning_run")}


def _check_table(path: Path, jobs: dict[subprocess.Popen[str], list[int]]) -> dict:
    """What must hold whichever job tuned which bucket: one winner per bucket asked for, each
    job's run finished, every trial it reported in the table under its run and none twice, and
    each winner credited to the run that measured it."""
    outcomes = {job: _outcomes(job) for job in jobs}
    for job, buckets in jobs.items():
        assert sorted(outcomes[job]) == sorted(buckets)
    runs = _runs(path)
    assert sorted(runs) == sorted(job.pid for job in jobs)
    assert {status for _, status in runs.values()} == {RunStatus.FINISHED.value}
    per_run = Counter(run for run, in _query(path, "SELECT run_id FROM measurement"))
    for job in jobs:
        assert per_run[runs[job.pid][0]] == sum(n for _, n in outcomes[job].values())
    trials = _query(path, "SELECT b.num_tokens, m.kernel, m.params FROM measurement m "
                          "JOIN bucket b ON b.id = m.bucket_id")
    assert len(trials) == len(set(trials)), "a trial was measured twice"
    winners = _query(path, "SELECT b.num_tokens, w.run_id, w.kernel, w.params FROM winner w "
                           "JOIN bucket b ON b.id = w.bucket_id")
    assert sorted(m for m, *_ in winners) == sorted({m for b in jobs.values() for m in b})
    for m, run, kernel, params in winners:
        assert _query(path, "SELECT m.run_id FROM measurement m JOIN bucket b ON b.id = "
                            "m.bucket_id WHERE b.num_tokens = ? AND m.kernel = ? AND "
                            "m.params = ?", m, kernel, params) == [(run,)]
    return outcomes


def test_two_jobs_on_disjoint_buckets_keep_every_bucket_run_and_trial(tmp_path):
    path = tmp_path / "t.db"
    a, b = [1, 2, 4, 8], [16, 24, 32, 48]
    jobs = {_tune(path, a): a, _tune(path, b): b}
    outcomes = _check_table(path, jobs)
    assert all(skipped is None for o in outcomes.values() for skipped, _ in o.values())


def test_two_jobs_on_overlapping_buckets_tune_each_bucket_once(tmp_path):
    path = tmp_path / "t.db"
    a, b = [1, 2, 4, 8, 16], [4, 8, 16, 24, 32]
    first, second = _tune(path, a), _tune(path, b)
    outcomes = _check_table(path, {first: a, second: b})
    for m in (4, 8, 16):  # tuned by one job; the other left it or re-confirmed it
        (skip_a, n_a), (skip_b, n_b) = outcomes[first][m], outcomes[second][m]
        assert {skip_a, skip_b} <= {None, "another job is tuning it"}
        # Re-confirming, a job measures nothing again; at most the winners of the two
        # neighbouring buckets, where those were published after the other job's search.
        assert (skip_a is None or skip_b is None) and min(n_a, n_b) <= 2 and max(n_a, n_b) > 0


def _hold_write(path: Path) -> subprocess.Popen[str]:
    """A process inside ``write_table(path)`` (its lock held, its copy open) until killed."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from moetune.db import write_table
        with write_table({str(path)!r}):
            print("holding", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def _temp_copies(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))


def _kill(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL


def test_a_killed_job_is_marked_interrupted_and_its_temp_copy_removed(tmp_path):
    path = tmp_path / "t.db"
    job = _tune(path, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256])  # killed long before the end
    deadline = time.monotonic() + 300
    while not (path.exists() and _query(path, "SELECT COUNT(*) FROM winner")[0][0]):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.2)
    holder = _hold_write(path)  # the job's next publish waits for this writer
    _kill(job)                  # mid-run: its run row says running, its claims die with it
    _kill(holder)               # mid-write: its temporary copy stays behind
    assert _runs(path)[job.pid][1] == RunStatus.RUNNING.value
    assert len(_temp_copies(path)) == 1
    finished = _query(path, "SELECT COUNT(*) FROM winner")[0][0]

    with write_table(path, lock_timeout=10):  # the next writer
        pass
    assert _runs(path)[job.pid][1] == RunStatus.INTERRUPTED.value
    assert _temp_copies(path) == []
    assert _query(path, "SELECT COUNT(*) FROM winner")[0][0] == finished
    assert list(tmp_path.glob("*-journal")) == []


def test_a_writer_that_waits_too_long_names_the_table_and_the_holder(tmp_path):
    path = tmp_path / "t.db"
    with write_table(path):
        pass
    holder = _hold_write(path)
    try:
        start = time.monotonic()
        with pytest.raises(TableLockError) as excinfo:
            with write_table(path, lock_timeout=1):
                pytest.fail("the body must not run")
        assert 1 <= time.monotonic() - start < 30
        message = str(excinfo.value)
        assert message.startswith(f"{path}: another writer held the table for more than 1s")
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message
        assert len(_temp_copies(path)) == 1  # a live writer's copy is left alone
    finally:
        _kill(holder)


def test_a_bucket_claim_is_exclusive_and_dies_with_its_holder(tmp_path):
    path = tmp_path / "t.db"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from moetune.db import claim_in
        with claim_in({str(path)!r}, "bucket 8") as mine:
            print(mine, flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "True"
    with claim_in(path, "bucket 8") as mine, claim_in(path, "bucket 16") as other:
        assert (mine, other) == (False, True)
    _kill(holder)
    with claim_in(path, "bucket 8") as mine:
        assert mine


def test_a_reconfirmed_winner_keeps_the_run_that_measured_it(tmp_path, cpu_sku):
    path = tmp_path / "t.db"
    problem = preset("tiny").shape.problem(8)
    opts = JobOptions(device="cpu", trials=2, reps=2)
    first = run_job([problem], path, cpu_sku, opts)
    again = run_job([problem], path, cpu_sku, opts)  # every trial known: confirmed, not measured
    assert first[0].measured > 0 and (again[0].measured, again[0].reused) == (0, first[0].measured)
    assert _query(path, "SELECT id, status FROM tuning_run") == [(1, "finished"), (2, "finished")]
    assert _query(path, "SELECT run_id FROM winner") == [(1,)]
