"""Tuning runs record the device's measured ceilings.

Revision ID: 0005_run_ceilings
Revises: 0004_run_pid
Create Date: 2026-12-01

``tuning_run.ceilings``: a JSON object measured when a run starts on a GPU, the HBM bandwidth
(``hbm_bytes_per_s``, the better of ``copy_bytes_per_s`` and ``read_bytes_per_s``) and the
dense matmul rates (``bf16_flops``, ``fp8_flops``). ``moetune report`` draws each bucket's HBM
and compute floors from them. Runs on the CPU, and runs from before 0005, have none.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_run_ceilings"
down_revision: str | Sequence[str] | None = "0004_run_pid"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("tuning_run") as batch:
        batch.add_column(sa.Column("ceilings", sa.Text(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("tuning_run") as batch:
        batch.drop_column("ceilings")
