"""Each stored rule variant names the vLLM release whose pick it stands for.

Revision ID: 0007_baseline_vllm
Revises: 0006_readable_intervals
Create Date: 2026-12-08

``winner.baselines`` becomes ``{"schema": 2, "variants": [...]}``, each variant with ``vllm``
(the vLLM version whose pick it stands for, or null) and ``configs`` (the vLLM tuned-config
file its config came from, ``"default"`` for vLLM's default heuristic, or null), so serving
can tell a row timed against vLLM 0.32's pick from one timed against 0.34's. Every row stored
before was timed in vLLM 0.32's days: ``aiter_triton`` variants (moetune's emulation of vLLM
0.32's Triton pick with its configs) and ``vllm_cpu_experts`` (its CPU kernel) get ``0.32.0``,
every other kernel (the torch loop) null; ``configs`` is not known and stays null. The mapping
is copied here, not imported (``moetune.db._baselines.SCHEMA1_VLLM`` reads schema-1 text the
same way), so the migration keeps doing what it did. Baselines that are not JSON, or not of
schema 1, are left as they are (readers report such a row as faulty); NULL ones too (imports,
and rows from before 0003, read from their ``baseline_*`` columns).
"""

import json
from collections.abc import Callable, Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_baseline_vllm"
down_revision: str | Sequence[str] | None = "0006_readable_intervals"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The vLLM each kernel's schema-1 variants stand for.
VLLM_0_32 = {"aiter_triton": "0.32.0", "vllm_cpu_experts": "0.32.0"}


def _upgraded(text: str) -> str | None:
    """``text`` as schema 2, or ``None`` where it is not schema-1 baselines."""
    try:
        value = json.loads(text)
        variants = value["variants"]
    except (ValueError, TypeError, KeyError):
        return None
    if "schema" in value or not isinstance(variants, list):
        return None
    for v in variants:
        if isinstance(v, dict):
            kernel = v.get("kernel")
            v["vllm"] = VLLM_0_32.get(kernel) if isinstance(kernel, str) else None
            v["configs"] = None
    value["schema"] = 2
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _downgraded(text: str) -> str | None:
    """``text`` as schema 1 (the versions dropped), or ``None`` where it is not schema 2."""
    try:
        value = json.loads(text)
    except (ValueError, TypeError):
        return None
    if not isinstance(value, dict) or value.get("schema") != 2:
        return None
    del value["schema"]
    for v in value.get("variants") or ():
        if isinstance(v, dict):
            v.pop("vllm", None)
            v.pop("configs", None)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _rewrite(change: Callable[[str], str | None]) -> None:
    winner = sa.table("winner", sa.column("id", sa.Integer), sa.column("baselines", sa.Text))
    connection = op.get_bind()
    rows = connection.execute(sa.select(winner.c.id, winner.c.baselines)
                              .where(winner.c.baselines.is_not(None))).all()
    for row_id, text in rows:
        changed = change(text)
        if changed is not None:
            connection.execute(winner.update().where(winner.c.id == row_id)
                               .values(baselines=changed))


def upgrade() -> None:
    """Upgrade schema."""
    _rewrite(_upgraded)


def downgrade() -> None:
    """Downgrade schema: variants lose the vLLM and configs they stand for."""
    _rewrite(_downgraded)
