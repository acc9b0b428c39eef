"""Winner rows record every rule variant they were timed against.

Revision ID: 0003_winner_baselines
Revises: 0002_winner_source
Create Date: 2026-12-01

``winner.baselines``: a JSON list, one object per variant of the rule measured in the same
confirmation as the winner (vLLM's default config, its tuned-file entry, aiter's rule, ...):
``kernel``, ``params``, ``median_us``, ``p20_us``, ``p80_us``, ``rounds``, ``ratio_lo``,
``ratio_hi`` (the confidence interval of the winner's speedup over it; rows from 0e08733 on also hold ``rounds`` and ``disturbed``) and ``beaten``.
Serving uses a row where today's rule is among them and was beaten, so a table stays valid for
users with and without vLLM's tuned files. Rows from 0002 have one baseline (``baseline_*``).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_winner_baselines"
down_revision: str | Sequence[str] | None = "0002_winner_source"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("winner") as batch:
        batch.add_column(sa.Column("baselines", sa.Text(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("winner") as batch:
        batch.drop_column("baselines")
