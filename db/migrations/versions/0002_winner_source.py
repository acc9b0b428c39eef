"""Winner rows say where they came from; imported rows carry no invented times.

Revision ID: 0002_winner_source
Revises: 0001_initial
Create Date: 2026-11-30

``winner.source``: ``measured`` (a tuning run timed it against the rule), ``vllm-json`` (a vLLM
tuned-config entry: no time), ``aiter-csv`` (an aiter tuned_fmoe.csv row: aiter's time, no
baseline). The times of imported rows become nullable. 0001 tables marked their imports only by
convention: no error (the gate always records one) and, for vLLM files, a 1e9 us placeholder.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_winner_source"
down_revision: str | Sequence[str] | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNMEASURED_US = 1e9  # 0001's placeholder time of an imported vLLM config
TIMES = ("median_us", "p20_us", "p80_us", "baseline_us", "speedup")
winner = sa.table("winner", sa.column("source", sa.String()), sa.column("error", sa.Double()),
                  *(sa.column(c, sa.Double()) for c in TIMES))


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("winner") as batch:
        batch.add_column(sa.Column("source", sa.String(16), nullable=False,
                                   server_default="measured"))
        for column in TIMES:
            batch.alter_column(column, existing_type=sa.Double(), nullable=True)
    imported = winner.c.error.is_(None)
    op.execute(winner.update().where(imported, winner.c.median_us == UNMEASURED_US)
               .values(source="vllm-json", **dict.fromkeys(TIMES)))
    op.execute(winner.update().where(imported, winner.c.source == "measured")
               .values(source="aiter-csv", baseline_us=None, speedup=None))


def downgrade() -> None:
    """Downgrade schema: imports get 0001's placeholders back."""
    for column in ("median_us", "p20_us", "p80_us"):
        op.execute(winner.update().where(winner.c[column].is_(None))
                   .values({column: UNMEASURED_US}))
    op.execute(winner.update().where(winner.c.baseline_us.is_(None))
               .values(baseline_us=winner.c.median_us))
    op.execute(winner.update().where(winner.c.speedup.is_(None)).values(speedup=1.0))
    with op.batch_alter_table("winner") as batch:
        for column in TIMES:
            batch.alter_column(column, existing_type=sa.Double(), nullable=False)
        batch.drop_column("source")
