"""Tuning runs record their process id.

Revision ID: 0004_run_pid
Revises: 0003_winner_baselines
Create Date: 2026-12-01

``tuning_run.pid``: the tuner's process id on ``host``. Several jobs may write one table file;
one that is killed leaves its run ``running``, and the next writer on that host marks it
``interrupted`` when the process is gone. Runs from before 0004 have no pid and are left as
they are.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_run_pid"
down_revision: str | Sequence[str] | None = "0003_winner_baselines"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("tuning_run") as batch:
        batch.add_column(sa.Column("pid", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("tuning_run") as batch:
        batch.drop_column("pid")
