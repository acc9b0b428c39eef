"""Stored speedup intervals that say nothing are cleared.

Revision ID: 0006_readable_intervals
Revises: 0005_run_ceilings
Create Date: 2026-12-07

Confirmations decided on few clean rounds stored intervals such as ``0.0``-``7.5e+04`` and
``ratio_hi`` 2e+231 in ``winner.baselines``: true at the confidence used, but no bound a reader
or a later computation can use. From this revision the tuner stores ``null`` for both bounds
where they are not finite and positive, come from fewer than 2 rounds or lie more than
``WIDEST`` apart (``moetune.tuner.timing.readable_bounds``); this migration applies that rule to
rows stored before. The rule is copied here, not imported, so the migration keeps doing what it
did when the tuner's rule changes. ``beaten`` and every time are kept. Baselines that are not
JSON are left as they are (readers already report such a row as faulty).
"""

import json
import math
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0006_readable_intervals"
down_revision: str | Sequence[str] | None = "0005_run_ceilings"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: ``moetune.tuner.timing.WIDEST`` as of this revision.
WIDEST = 10.0


def _readable(variant: dict[str, Any]) -> bool:
    lo, hi, rounds = variant.get("ratio_lo"), variant.get("ratio_hi"), variant.get("rounds")
    if not isinstance(lo, (int, float)) or not isinstance(hi, (int, float)):
        return False
    if isinstance(rounds, int) and rounds < 2:
        return False
    return 0.0 < lo <= hi < math.inf and hi <= WIDEST * lo


def _repaired(text: str) -> str | None:
    """``text`` with unreadable bounds set to null, or ``None`` if nothing changes."""
    try:
        value = json.loads(text)
        variants = value["variants"]
    except (ValueError, TypeError, KeyError):
        return None
    changed = False
    for v in variants if isinstance(variants, list) else ():
        stored = isinstance(v, dict) and (v.get("ratio_lo"), v.get("ratio_hi")) != (None, None)
        if stored and not _readable(v):
            v["ratio_lo"] = v["ratio_hi"] = None
            changed = True
    return json.dumps(value, sort_keys=True, separators=(",", ":")) if changed else None


def upgrade() -> None:
    """Upgrade schema."""
    winner = sa.table("winner", sa.column("id", sa.Integer), sa.column("baselines", sa.Text))
    connection = op.get_bind()
    rows = connection.execute(sa.select(winner.c.id, winner.c.baselines)
                              .where(winner.c.baselines.is_not(None))).all()
    for row_id, text in rows:
        repaired = _repaired(text)
        if repaired is not None:
            connection.execute(winner.update().where(winner.c.id == row_id)
                               .values(baselines=repaired))


def downgrade() -> None:
    """Downgrade schema: nothing to undo (the cleared bounds carried no information)."""
