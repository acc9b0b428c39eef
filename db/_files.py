"""Opening tables, and writing them so a reader never sees one half-written.

Serving reads tables that the tuner, ``export`` and ``merge`` replace; a crash or an error in the
middle of a write must leave the previous file exactly as it was. ``write_table`` therefore works
on a temporary file in the same directory and ``os.replace``s it into place only on success.
Several processes may write one file: each write holds the table's lock (``_locks``) from the
copy to the replace, so every write starts from the current file and none is lost. The writer
that takes the lock also cleans up after killed ones: it removes their temporary copies and
marks their runs ``interrupted``. A table may also live in a database server (a URL such as
``postgresql+psycopg://host/db``): there each session is one transaction (see ``_server``).
"""

import contextlib
import os
import re
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from alembic import command
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

from moetune.db._schema import (
    HEAD_REVISION,
    alembic_config,
    check_revision,
    connect_readonly,
    create_schema,
    error_reason,
    file_path,
    inspect_file,
    is_url,
    make_engine,
    sqlite_url,
    upgrade_schema,
)
from moetune.db._locks import LOCK_TIMEOUT_S, bucket_claim, publish_lock
from moetune.db._server import claim, display_url, open_server_table
from moetune.db._tuning import mark_interrupted
from moetune.errors import TableError


class TableFile:
    """An open table file: its engine, and sessions whose database errors are ``TableError``.

    The engine may be shared between threads; a session may not. ``revision`` is the schema
    revision of the file on disk. Close the file (or use it as a context manager) to release
    its connections.
    """

    def __init__(self, path: Path | str, engine: Engine, revision: str, *,
                 writable: bool) -> None:
        self.path = path
        self.engine = engine
        self.revision = revision
        self.writable = writable

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """A session inside one transaction: committed on success, rolled back on any error.

        Objects stay readable after the block (``expire_on_commit=False``), so a caller can keep
        the rows it created, e.g. the ``TuningRun`` it finishes later in another session.

        Raises:
            TableError: For any database error, or a stored value of the wrong type, naming
                the file.
        """
        try:
            with Session(self.engine, expire_on_commit=False) as session, session.begin():
                yield session
        except SQLAlchemyError as e:
            raise TableError(f"{self.path}: {error_reason(e)}") from e
        except (ValueError, TypeError, LookupError, OverflowError) as e:
            # Reading, only a stored value SQLAlchemy cannot turn into its column's type (a
            # date that is not one, an unknown enum value) raises these; writing, an integer
            # copied from such a file overflows. Either way the file was edited or damaged.
            if self.writable and not isinstance(e, OverflowError):
                raise  # a writer's own check (``set_winner``) refusing its arguments
            raise TableError(f"{self.path}: a stored value is not of its column's type ({e})"
                             ) from e

    def close(self) -> None:
        """Release every pooled connection to the file."""
        self.engine.dispose()

    def __enter__(self) -> "TableFile":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "writable" if self.writable else "read-only"
        return f"TableFile({str(self.path)!r}, {mode}, revision={self.revision!r})"


def open_table(path: str | Path, *, writable: bool = False) -> TableFile:
    """Open a table file after checking it is one this moetune can use.

    Read-only opens never write to the file: an older schema is upgraded in an in-memory copy.
    Writable opens create a missing file with the head schema and upgrade an older one in place.
    Writing in place is neither atomic across sessions nor serialized with other writers; use
    :func:`write_table` for that.

    Args:
        path: The SQLite table file, or a database server's URL.
        writable: Open for writing (creating or upgrading the file as needed).

    Returns:
        The open table; close it when done.

    Raises:
        TableError: If the file is missing (read-only), empty, truncated, not SQLite, not a
            moetune table, or written by a newer moetune schema.
    """
    if is_url(path):
        engine, shown = open_server_table(str(path), writable=writable)
        return TableFile(shown, engine, HEAD_REVISION, writable=writable)
    path = file_path(path)
    try:
        if writable and not path.exists():
            create_schema(path)
        state = inspect_file(path)
        check_revision(path, state)
        if state.revision == HEAD_REVISION:
            engine = make_engine(sqlite_url(path, readonly=not writable))
        elif writable:
            upgrade_schema(path)
            state = inspect_file(path)
            engine = make_engine(sqlite_url(path))
        else:
            engine = _upgraded_in_memory(path)
    except SQLAlchemyError as e:
        raise TableError(f"{path}: {error_reason(e)}") from e
    return TableFile(path, engine, state.revision, writable=writable)


@contextlib.contextmanager
def write_table(path: str | Path, *,
                lock_timeout: float = LOCK_TIMEOUT_S) -> Iterator[TableFile]:
    """Change a table file all at once, or not at all, and never over another writer's change.

    Yields a writable copy of ``path`` (or a new table when ``path`` does not exist), kept in a
    temporary file next to it (that is the yielded table's ``.path``). When the block finishes,
    the copy atomically replaces ``path``; when it raises, the copy is deleted and ``path`` is
    untouched. Readers keep seeing the old file until the replace. The table's lock is held
    from before the copy until after the replace (waiting up to ``lock_timeout`` seconds for
    another writer); runs whose process is gone are marked ``interrupted`` in the copy.

    A server URL is opened for writing instead: each of the block's sessions commits on its
    own, all or nothing, so callers put what must land together in one session.

    Raises:
        TableLockError: Another process held the table's lock for all of ``lock_timeout``.
        TableError: If the directory is missing or not writable (checked before any work), or
            if the existing file is not a table this moetune can use.
    """
    if is_url(path):
        with open_table(path, writable=True) as table:
            yield table
        return
    with atomic_table(path, start_from_existing=True, lock_timeout=lock_timeout) as table:
        yield table


@contextlib.contextmanager
def atomic_table(path: str | Path, *, start_from_existing: bool,
                 lock_timeout: float = LOCK_TIMEOUT_S) -> Iterator[TableFile]:
    """``write_table``, optionally starting from an empty schema instead of ``path``'s rows.

    Exports and merges build their output from scratch, even when ``out`` already exists.

    Raises:
        TableError: ``path`` is a server URL: exports and merges write table files.
        TableLockError: Another process held the table's lock for all of ``lock_timeout``.
    """
    if is_url(path):
        raise TableError(f"{display_url(str(path))}: exports and merges write a table file, "
                         "not a database")
    path = file_path(path)
    directory = path.absolute().parent
    if not directory.is_dir():
        raise TableError(f"{path}: cannot write, directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise TableError(f"{path}: cannot write, directory {directory} is not writable")
    with publish_lock(path, lock_timeout):  # a special directory (/proc) fails here
        _remove_leftovers(path)
        existing = path.exists()
        if existing:
            # Never replace a file that is not a moetune table, nor one of a newer schema.
            check_revision(path, inspect_file(path))
        try:
            fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                             dir=directory)
        except OSError as e:
            raise TableError(f"{path}: cannot write in directory {directory}: "
                             f"{e.strerror or e}") from e
        os.close(fd)
        temp = Path(temp_name)
        try:
            if existing and start_from_existing:
                _copy_file(path, temp)
            else:
                create_schema(temp)
            with open_table(temp, writable=True) as table:
                if existing and start_from_existing:
                    with table.session() as session:
                        mark_interrupted(session)
                yield table
            _fsync(temp)
            try:
                os.chmod(temp, os.stat(path).st_mode & 0o7777 if existing else 0o644)
                os.replace(temp, path)
            except OSError as e:  # an immutable or vanished file: it stays as it was
                raise TableError(f"{path}: cannot replace it ({e.strerror or e}); left as it "
                                 "was") from e
            _fsync(directory)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two targets name one table: the same file (also through a link or a
    ``sqlite:///`` URL), or the same server URL."""
    if is_url(a) or is_url(b):
        return a == b
    first, second = file_path(a), file_path(b)
    try:
        return first.exists() and second.exists() and os.path.samefile(first, second) or \
            first.absolute() == second.absolute()
    except OSError:
        return first.absolute() == second.absolute()


def _remove_leftovers(path: Path) -> None:
    """Delete the temporary copies (and their SQLite journals) of writes to ``path`` that were
    killed before their replace. Called under the table's lock: no live writer has one open."""
    leftover = re.compile(rf"\.{re.escape(path.name)}\.[^.]+\.tmp(-journal)?")
    for entry in path.absolute().parent.iterdir():
        if leftover.fullmatch(entry.name):
            entry.unlink(missing_ok=True)


def _copy_file(source: Path, target: Path) -> None:
    """Copy with SQLite's online backup: a consistent snapshot even mid-write by another process.

    Raises:
        TableError: If SQLite cannot read ``source`` or write ``target``.
    """
    try:
        with contextlib.closing(connect_readonly(source)) as src:
            with contextlib.closing(sqlite3.connect(target)) as dst:
                src.backup(dst)
    except sqlite3.Error as e:
        raise TableError(f"{source}: cannot copy to {target} ({e})") from e


def _upgraded_in_memory(path: Path) -> Engine:
    """A private in-memory copy of an older table, migrated to head, for read-only use."""
    engine = make_engine("sqlite://", foreign_keys=False, poolclass=StaticPool)
    with contextlib.closing(connect_readonly(path)) as source, engine.connect() as connection:
        source.backup(connection.connection.dbapi_connection)
    with engine.begin() as connection:
        command.upgrade(alembic_config(connection=connection), "head")
    return engine


def _fsync(path: Path) -> None:
    """Flush a file (or a directory entry) to disk, so a power cut cannot undo the replace.

    Best effort: some platforms cannot open or fsync a directory; the replace is atomic anyway.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def claim_in(path: str | Path, name: str) -> Iterator[bool]:
    """Hold the claim ``name`` on the table at ``path`` for the block if no other job holds it:
    yields whether this job may work on ``name`` now. A lock file beside a table file
    (``_locks.bucket_claim``), an advisory lock on a server (``_server.claim``); either is gone
    with a job that dies.

    Raises:
        TableError: the claim's lock file cannot be made, or the server table cannot be opened.
    """
    if not is_url(path):
        with bucket_claim(file_path(path), name) as mine:
            yield mine
        return
    with open_table(path, writable=True) as table, claim(table.engine, name) as mine:
        yield mine
