"""Alembic migrations of moetune table files (configured in ``moetune.db._schema``)."""
