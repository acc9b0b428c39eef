"""Locks for a table file, so that several processes can write one table safely.

A table file is replaced whole on every write (``write_table``: copy, write, replace); two jobs
copying it at once would each replace the other's rows. So every write holds the table's
*publish* lock from the copy to the replace, and a job holds a *claim* on each bucket while it
tunes it. Both are ``filelock`` locks (``flock`` on Unix): the operating system drops them when
their process exits or is killed, so a dead job never blocks another one.

The lock files live outside the user's folders (``_locks_dir``): a lock file cannot be deleted
safely while another process may be about to lock it, so they stay, and a checkout or model
folder holding a table must not collect them.
"""

import contextlib
import datetime
import getpass
import hashlib
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from moetune.errors import TableError, TableLockError

#: How long a writer waits for another one to finish its write (a write takes seconds).
LOCK_TIMEOUT_S = 120.0


def _locks_dir(path: Path) -> Path:
    """The table's lock directory, created on first use: ``NAME-HASH/`` (``HASH`` of the
    table's resolved path, so every process meets the same locks whichever path it was given)
    under ``$MOETUNE_LOCK_DIR``, by default ``moetune-locks-USER`` in the system's temporary
    folder. Writers on several hosts, or as several users, of one table file share locks only
    if ``MOETUNE_LOCK_DIR`` names one folder all of them can write (a PostgreSQL table needs
    none).

    Raises:
        TableError: The directory cannot be created.
    """
    base = os.environ.get("MOETUNE_LOCK_DIR") or Path(tempfile.gettempdir()) / (
        f"moetune-locks-{getpass.getuser()}")
    resolved = str(path.resolve())
    digest = hashlib.blake2b(resolved.encode(), digest_size=8).hexdigest()
    directory = Path(base) / f"{path.name}-{digest}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TableError(f"{path}: cannot write its lock directory {directory} "
                         f"({e.strerror or e})") from e
    return directory


@contextlib.contextmanager
def publish_lock(path: Path, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold ``path``'s publish lock for the block, waiting at most ``timeout`` seconds for it.

    The holder writes its host, pid and start time beside the lock, so a writer that gives up
    can say who held the table.

    Raises:
        TableLockError: Another process held the lock for all of ``timeout``.
        TableError: The lock cannot be created.
    """
    directory = _locks_dir(path)
    lock = FileLock(directory / "publish.lock", timeout=timeout)
    holder = directory / "publish.holder"
    try:
        lock.acquire()
    except Timeout:
        raise TableLockError(
            f"{path}: another writer held the table for more than {timeout:g}s "
            f"({_holder_text(holder)}; lock {directory / 'publish.lock'}); a killed process "
            "loses its lock, so that writer is still running: wait for it or stop it"
        ) from None
    except OSError as e:
        raise TableError(f"{path}: cannot take its lock in {directory} ({e.strerror})") from e
    try:
        holder.write_text(f"held by pid {os.getpid()} on host {socket.gethostname()} "
                          f"since {_now()}")
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def bucket_claim(path: Path, name: str) -> Iterator[bool]:
    """Try to claim ``name`` (a bucket) of the table at ``path`` for the block, without waiting:
    yields whether this job has it. Another process holding it keeps it until it exits.

    Raises:
        TableError: The claim's lock file cannot be created.
    """
    digest = hashlib.blake2b(name.encode(), digest_size=12).hexdigest()
    lock = FileLock(_locks_dir(path) / f"claim-{digest}.lock", timeout=0)  # one try
    try:
        lock.acquire()
        mine = True
    except Timeout:
        mine = False
    except OSError as e:
        raise TableError(f"{path}: cannot claim {name} ({e.strerror})") from e
    try:
        yield mine
    finally:
        if mine:
            lock.release()


def _holder_text(holder: Path) -> str:
    try:
        return holder.read_text().strip() or "holder not recorded"
    except OSError:
        return "holder not recorded"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
