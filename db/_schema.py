"""Schema lifecycle of a table file: engines, the Alembic config, validation, creation, upgrades.

Everything that decides "is this file a moetune table, and of which schema" lives here, so
``open_table`` and ``write_table`` give the same answer and the same error text.
"""

import dataclasses
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import quote

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, inspect
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from moetune.db._models import Base
from moetune.errors import TableError

#: The schema revision this moetune writes; a test checks it equals the newest migration.
HEAD_REVISION = "0007_baseline_vllm"

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
TABLE_NAMES = frozenset(Base.metadata.tables)
_SQLITE_MAGIC = b"SQLite format 3\x00"
_HEADER_SIZE = 100


@dataclasses.dataclass(frozen=True)
class FileState:
    """What a valid SQLite file with an ``alembic_version`` row says about itself."""

    revision: str
    tables: frozenset[str]


def sqlite_url(path: Path, *, readonly: bool = False) -> URL:
    """The SQLAlchemy URL of a table file; read-only uses SQLite's ``mode=ro`` URI.

    Read-only matters beyond safety: a table shipped inside site-packages may sit in a directory
    the serving process cannot write, and ``mode=ro`` never creates a missing file.
    """
    if readonly:
        uri_path = quote(str(Path(path).absolute()))
        query = {"mode": "ro", "uri": "true"}
        return URL.create("sqlite", database=f"file:{uri_path}", query=query)
    return URL.create("sqlite", database=str(path))


def connect_readonly(path: Path) -> sqlite3.Connection:
    """A raw read-only DBAPI connection, for SQLite's online backup (a consistent copy even
    while another process writes)."""
    return sqlite3.connect(f"file:{quote(str(Path(path).absolute()))}?mode=ro", uri=True)


def is_url(target: str | Path) -> bool:
    """Whether ``target`` names a database server (``postgresql+psycopg://...``), not a file.

    A ``sqlite:///`` URL of a file names that file (``file_path``): it gets the file's locks,
    bucket claims and atomic replace, as the plain path does.
    """
    return isinstance(target, str) and "://" in target and _sqlite_file(target) is None


def file_path(target: str | Path) -> Path:
    """The table file ``target`` names: a path, or a ``sqlite:///`` URL of a file.

    Raises:
        TableError: The name is not valid UTF-8, which SQLite's file names must be.
    """
    path = (_sqlite_file(target) or Path(target)) if isinstance(target, str) else Path(target)
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise TableError(f"{ascii(str(path))}: a table file's name must be valid UTF-8") from None
    return path


def _sqlite_file(target: str) -> Path | None:
    """The file of a ``sqlite:///PATH`` URL; None for anything else (a server, memory)."""
    if not target.startswith("sqlite") or "://" not in target:
        return None
    try:
        url = make_url(target)
    except ArgumentError:
        return None
    database = url.database
    if not database or database == ":memory:" or url.query.get("mode") == "memory":
        return None
    return Path(database[len("file:"):] if database.startswith("file:") else database)


def make_engine(url: URL | str, *, foreign_keys: bool = True, **kwargs: Any) -> Engine:
    """An engine with transactional DDL and (unless disabled) enforced foreign keys.

    pysqlite commits implicitly before DDL, so a crash in the middle of a migration could leave
    half a schema; emitting our own ``BEGIN`` makes DDL transactional (SQLAlchemy's SQLite docs,
    "Using SQLAlchemy to emit BEGIN"). Listeners are per engine, never on the ``Engine`` class,
    so other SQLite users in the process (Optuna's storage) are left alone. Server databases
    (PostgreSQL) have transactional DDL and enforced keys already.
    """
    engine = create_engine(url, **kwargs)
    if engine.dialect.name != "sqlite":
        return engine

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        if foreign_keys:
            dbapi_connection.execute("PRAGMA foreign_keys=ON")

    def on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN")

    event.listen(engine, "connect", on_connect)
    event.listen(engine, "begin", on_begin)
    return engine


def alembic_config(
    path: str | Path | None = None, *, connection: Connection | None = None
) -> Config:
    """An Alembic config built in code (no alembic.ini), for ``alembic.command.*``.

    Args:
        path: Table file (or server URL) for commands that open their own connection
            (``check``, ``upgrade``).
        connection: An open connection for the migration to run in (``env.py`` prefers it).
    """
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # New migration files are named by their readable revision id alone: 0002_add_roofline.py.
    config.set_main_option("file_template", "%%(rev)s")
    if path is not None:
        url = str(path) if is_url(path) else sqlite_url(file_path(path)).render_as_string(
            hide_password=False)
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # configparser escaping
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def known_revisions() -> frozenset[str]:
    """Every revision id this moetune's migrations know."""
    script = ScriptDirectory.from_config(alembic_config())
    return frozenset(s.revision for s in script.walk_revisions())


def not_a_table(path: str | Path, what: str) -> TableError:
    """The one error text for files that are not moetune tables."""
    return TableError(f"{path}: not a moetune table ({what})")


def inspect_file(path: Path) -> FileState:
    """Check that ``path`` is a readable SQLite file stamped by Alembic; return what it holds.

    Raises:
        TableError: If the file is missing, empty, truncated, not SQLite, or has no single
            ``alembic_version`` row.
    """
    _check_header(path)
    engine = make_engine(sqlite_url(path, readonly=True), foreign_keys=False)
    try:
        with engine.connect() as connection:
            tables = frozenset(inspect(connection).get_table_names())
            if "alembic_version" not in tables:
                raise not_a_table(path, "no alembic_version table")
            heads = MigrationContext.configure(connection).get_current_heads()
    except SQLAlchemyError as e:
        raise not_a_table(path, f"unreadable: {error_reason(e)}") from e
    finally:
        engine.dispose()
    if len(heads) != 1:
        raise not_a_table(path, f"alembic_version holds {len(heads)} revisions, expected 1")
    return FileState(revision=heads[0], tables=tables)


def check_revision(path: str | Path, state: FileState) -> None:
    """Refuse a file whose schema this moetune cannot read.

    An unknown revision next to our tables means a newer moetune wrote the file; an unknown
    revision without them means some other Alembic-managed database (an Optuna study, say).

    Raises:
        TableError: For a newer schema (says to upgrade moetune) or a foreign database.
    """
    if state.revision not in known_revisions():
        if TABLE_NAMES.issubset(state.tables):
            raise TableError(
                f"{path}: written by a newer moetune schema (revision {state.revision!r}; this "
                f"moetune reads up to {HEAD_REVISION!r}); upgrade moetune to use this table"
            )
        what = f"unknown alembic revision {state.revision!r} and no moetune tables"
        raise not_a_table(path, what)
    if state.revision == HEAD_REVISION and not TABLE_NAMES.issubset(state.tables):
        missing = ", ".join(sorted(TABLE_NAMES - state.tables))
        raise not_a_table(path, f"missing tables: {missing}")


def create_schema(path: Path) -> None:
    """Give an empty or missing file the head schema: ``create_all`` then ``stamp head``.

    Raises:
        TableError: If SQLite cannot create or write the file.
    """
    engine = make_engine(sqlite_url(path))
    try:
        with engine.begin() as connection:
            Base.metadata.create_all(connection)
            command.stamp(alembic_config(connection=connection), "head")
    except SQLAlchemyError as e:
        raise TableError(f"{path}: cannot create the table ({error_reason(e)})") from e
    finally:
        engine.dispose()


def upgrade_schema(path: Path) -> None:
    """Migrate a table file to head, in place and in one transaction.

    Foreign keys are off while migrating: batch mode rebuilds tables by copying them, which
    would trip enforcement mid-way. ``PRAGMA foreign_key_check`` then proves nothing dangles.

    Raises:
        TableError: If the migration fails or leaves a dangling foreign key (it rolls back).
    """
    engine = make_engine(sqlite_url(path), foreign_keys=False)
    try:
        with engine.begin() as connection:
            command.upgrade(alembic_config(connection=connection), "head")
            dangling = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
            if dangling:
                raise TableError(f"{path}: upgrade left {len(dangling)} rows with dangling keys")
    except SQLAlchemyError as e:
        raise TableError(f"{path}: cannot upgrade the table ({error_reason(e)})") from e
    finally:
        engine.dispose()


def schema_revision(path: str | Path) -> str:
    """The Alembic revision a table file is stamped with (it may be newer than ours).

    Raises:
        TableError: If the file is missing or not a moetune table.
    """
    return inspect_file(file_path(path)).revision


def error_reason(error: SQLAlchemyError) -> str:
    """The driver's own message, without SQLAlchemy's statement dump and help link."""
    original = getattr(error, "orig", None)
    return str(original if original is not None else error).splitlines()[0]


def _check_header(path: Path) -> None:
    """Tell empty, non-SQLite and truncated files apart before SQLite gives a vaguer error.

    The header layout (page size at offset 16, page count at 28, valid only when the change
    counters at 24 and 92 agree) is from the SQLite file format documentation, section 1.3.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(_HEADER_SIZE)
    except FileNotFoundError:
        raise TableError(f"{path}: no such table file") from None
    except IsADirectoryError:
        raise TableError(f"{path}: is a directory, not a table file") from None
    except OSError as e:
        raise TableError(f"{path}: cannot read the table file ({e.strerror})") from e
    if not header:
        raise not_a_table(path, "empty file")
    if not (header.startswith(_SQLITE_MAGIC) or _SQLITE_MAGIC.startswith(header)):
        raise not_a_table(path, "not an SQLite file")
    if len(header) < _HEADER_SIZE:
        raise not_a_table(path, f"truncated: {size} bytes, shorter than the SQLite header")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    if header[24:28] == header[92:96] and size < page_size * pages:
        raise not_a_table(path, f"truncated: {size} of {page_size * pages} bytes")
