"""A real PostgreSQL server for the tests: initdb into a temporary folder, started on a free
loopback port with trust auth, stopped at the end. Skips (saying why) where the server binaries
or psycopg are missing."""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest


def _binaries() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                      key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unavailable(why: str) -> None:
    """Skip, saying why; fail where the test command installed the server
    (``MOETUNE_TEST_REQUIRE_SERVERS=1``, set by scripts/test.sh), so CI never skips these."""
    if os.environ.get("MOETUNE_TEST_REQUIRE_SERVERS") == "1":
        pytest.fail(f"PostgreSQL tests cannot run: {why}")
    pytest.skip(why)


def server() -> Iterator[Callable[[str], str]]:
    """Yields ``new_database(name) -> URL``; the server lives until the generator closes.

    Its folder is made under the system temp directory, which the ``postgres`` user can reach
    (pytest's own temp folders are private to the user running the tests)."""
    if importlib.util.find_spec("psycopg") is None:
        _unavailable("psycopg is not installed (pip install 'moetune[postgres]')")
    bin_dir = _binaries()
    if bin_dir is None:
        _unavailable("PostgreSQL server binaries (initdb, pg_ctl) not found: apt install postgresql")
    run_as: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            _unavailable("running as root and there is no postgres user to run the server")
        run_as = ["runuser", "-u", "postgres", "--"]
    tmp = Path(tempfile.mkdtemp(prefix="moetune-pg-"))
    if run_as:
        shutil.chown(tmp, "postgres")
    data, port = tmp / "data", _free_port()

    def pg(*args: str) -> None:
        subprocess.run([*run_as, *args], check=True, capture_output=True, timeout=120)

    pg(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    pg(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(tmp / "server.log"), "-w", "-o",
       f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
    import psycopg

    def new_database(name: str) -> str:
        with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres",
                             autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{port}/{name}"

    try:
        yield new_database
    finally:
        pg(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(tmp, ignore_errors=True)
