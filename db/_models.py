"""The ORM schema of a table file: SKUs, tuning runs, buckets, every measurement, and the winners.

The migrations in ``migrations/versions`` must produce exactly this schema; ``alembic check``
(run by the tests) fails when the two drift apart.
"""

import datetime
import enum
from typing import Annotated

import sqlalchemy
from sqlalchemy import DateTime, ForeignKey, MetaData, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Every constraint gets a deterministic name: SQLite batch migrations ("move and copy") and
# PostgreSQL ALTERs refer to constraints by name, so an unnamed one could never be changed.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: The natural keys, by column name: what identifies a SKU or a bucket across table files.
SKU_COLUMNS = ("vendor", "name", "arch", "compute_units", "memory_bytes")
BUCKET_COLUMNS = (
    "num_tokens", "hidden_size", "intermediate_size", "num_experts", "topk",
    "dtype", "quant", "activation", "gated", "router_weight_on_input",
)

#: Width of every enum column; leaves room for new members without a column migration.
ENUM_LENGTH = 16


class RunStatus(str, enum.Enum):
    """Where a tuning run is. Values are stable ids stored in tables."""

    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    #: Its process died (killed, crashed) while running; marked by the next writer of the table.
    INTERRUPTED = "interrupted"


class MeasurementStatus(str, enum.Enum):
    """Outcome of one trial: a failed or wrong candidate is a result, not an exception."""

    OK = "ok"
    FAILED = "failed"
    WRONG = "wrong"
    PRUNED = "pruned"


class Base(DeclarativeBase):
    """Declarative base: named constraints, and enums stored by value.

    Enums are stored as their ``.value`` in a plain string column (``native_enum=False``):
    the value is the stable id, and adding a member later needs no PostgreSQL ``ALTER TYPE``.
    """

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        enum.Enum: sqlalchemy.Enum(
            enum.Enum,
            values_callable=lambda members: [m.value for m in members],
            native_enum=False,
            length=ENUM_LENGTH,
        ),
    }


intpk = Annotated[int, mapped_column(primary_key=True)]
# Canonical JSON (sorted keys, no spaces); kept as text so a bad row can be skipped, not raised.
json_text = Annotated[str, mapped_column(Text)]
# Naive UTC: SQLite has no time zones, so every writer stores UTC and every reader assumes it.
utc_time = Annotated[datetime.datetime, mapped_column(DateTime())]
sku_fk = Annotated[int, mapped_column(ForeignKey("sku.id"))]
bucket_fk = Annotated[int, mapped_column(ForeignKey("bucket.id"))]
run_fk = Annotated[int, mapped_column(ForeignKey("tuning_run.id"))]


class SkuRow(Base):
    """A device model a table is measured on (``vendor`` is ``cpu``, ``nvidia`` or ``amd``)."""

    __tablename__ = "sku"
    __table_args__ = (UniqueConstraint("vendor", "name", "arch", "compute_units"),)

    id: Mapped[intpk]
    vendor: Mapped[str]
    name: Mapped[str]
    arch: Mapped[str]
    compute_units: Mapped[int]
    memory_bytes: Mapped[int] = mapped_column(sqlalchemy.BigInteger)

    def key(self) -> dict[str, object]:
        """The SKU as plain values, the form the read API hands out."""
        return {c: getattr(self, c) for c in SKU_COLUMNS}


class TuningRun(Base):
    """One tuner invocation with the provenance needed to trust (or distrust) its numbers."""

    __tablename__ = "tuning_run"

    id: Mapped[intpk]
    sku_id: Mapped[sku_fk]
    moetune_version: Mapped[str]
    commit: Mapped[str | None]
    environment: Mapped[json_text]
    driver: Mapped[str | None]
    host: Mapped[str]
    #: The tuner's process id on ``host`` (None before schema 0004): a writer that finds the
    #: process gone marks a run still ``running`` as ``interrupted``.
    pid: Mapped[int | None]
    command: Mapped[str] = mapped_column(Text)
    #: What the device sustains, measured when the run started on a GPU (JSON object:
    #: ``hbm_bytes_per_s``, ``bf16_flops``, ``fp8_flops``, ...; ``tuner.roofline.Ceilings``):
    #: reports draw each bucket's HBM and compute floors from it. None on the CPU and before
    #: schema 0005.
    ceilings: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[utc_time]
    finished_at: Mapped[datetime.datetime | None] = mapped_column(DateTime())
    status: Mapped[RunStatus]

    sku: Mapped[SkuRow] = relationship()


class BucketRow(Base):
    """A MoE problem with num_tokens replaced by its bucket: the unit a winner is chosen for."""

    __tablename__ = "bucket"
    __table_args__ = (UniqueConstraint(*BUCKET_COLUMNS),)

    id: Mapped[intpk]
    num_tokens: Mapped[int]
    hidden_size: Mapped[int]
    intermediate_size: Mapped[int]
    num_experts: Mapped[int]
    topk: Mapped[int]
    dtype: Mapped[str]
    quant: Mapped[str]
    activation: Mapped[str]
    gated: Mapped[bool]
    router_weight_on_input: Mapped[bool]

    def key(self) -> dict[str, object]:
        """The 10 key columns by name (the same names as ``MoEProblem.to_row()``)."""
        return {c: getattr(self, c) for c in BUCKET_COLUMNS}


class Measurement(Base):
    """One trial: a kernel with one parameter set on one bucket, in one run.

    Times are ``None`` when the trial did not produce a valid timing (``status`` says why).
    """

    __tablename__ = "measurement"

    id: Mapped[intpk]
    # Indexed: measurements are the table that grows, and resumed jobs look them up by bucket.
    run_id: Mapped[run_fk] = mapped_column(index=True)
    bucket_id: Mapped[bucket_fk] = mapped_column(index=True)
    kernel: Mapped[str]
    params: Mapped[json_text]
    median_us: Mapped[float | None]
    p20_us: Mapped[float | None]
    p80_us: Mapped[float | None]
    samples: Mapped[int]
    error: Mapped[float | None]
    status: Mapped[MeasurementStatus]
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[utc_time]

    run: Mapped[TuningRun] = relationship()
    bucket: Mapped[BucketRow] = relationship()


#: Where a winner row came from: a tuning run's measurement, or an import.
WINNER_SOURCES = ("measured", "vllm-json", "aiter-csv")


class WinnerRow(Base):
    """The fastest correct kernel of one bucket on one SKU, next to the baseline it beat."""

    __tablename__ = "winner"
    __table_args__ = (UniqueConstraint("sku_id", "bucket_id"),)

    id: Mapped[intpk]
    sku_id: Mapped[sku_fk]
    bucket_id: Mapped[bucket_fk]
    kernel: Mapped[str]
    params: Mapped[json_text]
    #: One of ``WINNER_SOURCES``. Imported rows have no baseline time or speedup, and rows
    #: from vLLM files no time at all.
    source: Mapped[str] = mapped_column(String(16), server_default="measured")
    median_us: Mapped[float | None]
    p20_us: Mapped[float | None]
    p80_us: Mapped[float | None]
    error: Mapped[float | None]
    baseline_kernel: Mapped[str]
    baseline_params: Mapped[json_text]
    baseline_us: Mapped[float | None]
    speedup: Mapped[float | None]
    #: Every rule variant timed beside the winner (``dump_baselines``: ``{"schema": 2,
    #: "variants": [...]}``); None for imported rows and for rows from before schema 0003.
    baselines: Mapped[str | None] = mapped_column(Text)
    run_id: Mapped[run_fk]
    updated_at: Mapped[utc_time]

    sku: Mapped[SkuRow] = relationship()
    bucket: Mapped[BucketRow] = relationship()
    run: Mapped[TuningRun] = relationship()
