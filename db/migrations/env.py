"""Alembic environment for table files; configured in code by ``moetune.db._schema.alembic_config``.

Migrations run on the connection passed in ``config.attributes["connection"]`` (so creating,
stamping and upgrading share one transaction with the caller), or on ``sqlalchemy.url`` when
Alembic commands such as ``check`` are pointed at a file.
"""

from alembic import context
from sqlalchemy import Connection

from moetune.db._models import Base
from moetune.db._schema import make_engine


def run_migrations_online() -> None:
    """Run migrations in batch mode: SQLite cannot ALTER, so tables are moved and copied."""
    config = context.config
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(config.get_main_option("sqlalchemy.url"), foreign_keys=False)
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise RuntimeError("moetune tables are migrated online only; offline SQL is not supported")
run_migrations_online()
