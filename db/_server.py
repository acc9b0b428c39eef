"""Tables in a database server (PostgreSQL), where several tuning jobs on several hosts write
into one database at once, and ``export`` makes the SQLite file that ships.

A server table is the same schema as a table file, migrated by the same Alembic scripts. It is
never half-written for the same reason a file is not: the tuner publishes each bucket in one
session, and a session is one transaction. Creating and upgrading the schema take an advisory
lock, so jobs that start together do not race to create it. A job claims each bucket while it
tunes it (``claim``), so jobs given the same buckets share them out instead of doubling work.
"""

import contextlib
import hashlib
from collections.abc import Iterator

from alembic import command
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from moetune.db._models import Base
from moetune.db._schema import (
    HEAD_REVISION,
    FileState,
    alembic_config,
    check_revision,
    error_reason,
    make_engine,
)
from moetune.errors import TableError

# pg_advisory_xact_lock key for schema changes: any constant shared by every moetune.
_SCHEMA_LOCK = 0x6D6F6574756E65


def display_url(url: str) -> str:
    """The URL as messages show it: the password hidden."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def open_server_table(url: str, *, writable: bool) -> tuple[Engine, str]:
    """An engine on a server table at the head schema, and the URL to name it by.

    Writable opens create the schema in an empty database and upgrade an older one; read-only
    opens change nothing and refuse an older schema (upgrading a shared database is a decision,
    not a side effect of reading it).

    Raises:
        TableError: The URL is malformed, its driver is missing, the server cannot be reached,
            or the database holds something else or a newer moetune schema.
    """
    shown = display_url(url)
    try:
        engine = make_engine(url, pool_pre_ping=True)
    except (ArgumentError, ImportError) as e:  # a malformed URL, a driver not installed
        raise TableError(f"{shown}: cannot open ({e}; PostgreSQL needs pip install "
                         "'moetune[postgres]')") from None
    try:
        with engine.begin() as connection:
            _ready(connection, shown, writable)
    except SQLAlchemyError as e:
        engine.dispose()
        raise TableError(f"{shown}: {error_reason(e)}") from e
    except TableError:
        engine.dispose()
        raise
    return engine, shown


def _ready(connection: Connection, shown: str, writable: bool) -> None:
    if writable and connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_SCHEMA_LOCK})")
    tables = frozenset(inspect(connection).get_table_names())
    if "alembic_version" not in tables:
        if tables & frozenset(Base.metadata.tables) or not writable:
            raise TableError(f"{shown}: no moetune table in this database"
                             + ("" if writable else " (tune or import into it first)"))
        Base.metadata.create_all(connection)
        command.stamp(alembic_config(connection=connection), "head")
        return
    heads = MigrationContext.configure(connection).get_current_heads()
    if len(heads) != 1:
        raise TableError(f"{shown}: not a moetune table (alembic_version holds {len(heads)} "
                         "revisions, expected 1)")
    check_revision(shown, FileState(heads[0], tables))
    if heads[0] != HEAD_REVISION:
        if not writable:
            raise TableError(f"{shown}: schema {heads[0]!r} is older than {HEAD_REVISION!r}; "
                             "open it for writing (tune or import into it) to upgrade it")
        command.upgrade(alembic_config(connection=connection), "head")


@contextlib.contextmanager
def claim(engine: Engine, name: str) -> Iterator[bool]:
    """Hold the claim ``name`` for the block if no other connection holds it: yields whether
    this job has it. A PostgreSQL session advisory lock: a job that dies loses its claims.
    Other databases have one writer at a time, so the claim is always granted."""
    if engine.dialect.name != "postgresql":
        yield True
        return
    key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big",
                         signed=True)
    with engine.connect() as connection:
        mine = bool(connection.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key})
                    .scalar())
        connection.commit()  # the lock outlives the transaction; nothing else to keep open
        try:
            yield mine
        finally:
            if mine:
                connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                connection.commit()
