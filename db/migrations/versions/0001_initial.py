"""Initial schema: sku, tuning_run, bucket, measurement, winner.

Revision ID: 0001_initial
Revises:
Create Date: 2025-11-30

Enum values are spelled out here rather than imported from the models: a migration must keep
describing the schema of its own revision after the models move on.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_initial"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RUN_STATUS = ("running", "finished", "failed")
MEASUREMENT_STATUS = ("ok", "failed", "wrong", "pruned")


def _enum(values: tuple[str, ...], name: str) -> sa.Enum:
    return sa.Enum(*values, name=name, native_enum=False, length=16)


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "sku",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("vendor", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("arch", sa.String(), nullable=False),
        sa.Column("compute_units", sa.Integer(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sku")),
        sa.UniqueConstraint("vendor", "name", "arch", "compute_units", name=op.f("uq_sku_vendor")),
    )
    op.create_table(
        "bucket",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("hidden_size", sa.Integer(), nullable=False),
        sa.Column("intermediate_size", sa.Integer(), nullable=False),
        sa.Column("num_experts", sa.Integer(), nullable=False),
        sa.Column("topk", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(), nullable=False),
        sa.Column("quant", sa.String(), nullable=False),
        sa.Column("activation", sa.String(), nullable=False),
        sa.Column("gated", sa.Boolean(), nullable=False),
        sa.Column("router_weight_on_input", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_bucket")),
        sa.UniqueConstraint(
            "num_tokens", "hidden_size", "intermediate_size", "num_experts", "topk",
            "dtype", "quant", "activation", "gated", "router_weight_on_input",
            name=op.f("uq_bucket_num_tokens"),
        ),
    )
    op.create_table(
        "tuning_run",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sku_id", sa.Integer(), nullable=False),
        sa.Column("moetune_version", sa.String(), nullable=False),
        sa.Column("commit", sa.String(), nullable=True),
        sa.Column("environment", sa.Text(), nullable=False),
        sa.Column("driver", sa.String(), nullable=True),
        sa.Column("host", sa.String(), nullable=False),
        sa.Column("command", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("status", _enum(RUN_STATUS, "runstatus"), nullable=False),
        sa.ForeignKeyConstraint(["sku_id"], ["sku.id"], name=op.f("fk_tuning_run_sku_id_sku")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tuning_run")),
    )
    op.create_table(
        "measurement",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("bucket_id", sa.Integer(), nullable=False),
        sa.Column("kernel", sa.String(), nullable=False),
        sa.Column("params", sa.Text(), nullable=False),
        sa.Column("median_us", sa.Double(), nullable=True),
        sa.Column("p20_us", sa.Double(), nullable=True),
        sa.Column("p80_us", sa.Double(), nullable=True),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("error", sa.Double(), nullable=True),
        sa.Column("status", _enum(MEASUREMENT_STATUS, "measurementstatus"), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["bucket_id"], ["bucket.id"], name=op.f("fk_measurement_bucket_id_bucket")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["tuning_run.id"], name=op.f("fk_measurement_run_id_tuning_run")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_measurement")),
    )
    op.create_index(op.f("ix_measurement_bucket_id"), "measurement", ["bucket_id"])
    op.create_index(op.f("ix_measurement_run_id"), "measurement", ["run_id"])
    op.create_table(
        "winner",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sku_id", sa.Integer(), nullable=False),
        sa.Column("bucket_id", sa.Integer(), nullable=False),
        sa.Column("kernel", sa.String(), nullable=False),
        sa.Column("params", sa.Text(), nullable=False),
        sa.Column("median_us", sa.Double(), nullable=False),
        sa.Column("p20_us", sa.Double(), nullable=False),
        sa.Column("p80_us", sa.Double(), nullable=False),
        sa.Column("error", sa.Double(), nullable=True),
        sa.Column("baseline_kernel", sa.String(), nullable=False),
        sa.Column("baseline_params", sa.Text(), nullable=False),
        sa.Column("baseline_us", sa.Double(), nullable=False),
        sa.Column("speedup", sa.Double(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["bucket_id"], ["bucket.id"], name=op.f("fk_winner_bucket_id_bucket")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["tuning_run.id"], name=op.f("fk_winner_run_id_tuning_run")
        ),
        sa.ForeignKeyConstraint(["sku_id"], ["sku.id"], name=op.f("fk_winner_sku_id_sku")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_winner")),
        sa.UniqueConstraint("sku_id", "bucket_id", name=op.f("uq_winner_sku_id")),
    )


def downgrade() -> None:
    """Downgrade schema."""
    for table in ("winner", "measurement", "tuning_run", "bucket", "sku"):
        op.drop_table(table)
