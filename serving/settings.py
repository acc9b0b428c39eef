"""The plugin's settings, read once per process from the environment."""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from pathlib import Path

from moetune.errors import InvalidProblemError
from moetune.runtime.problem import parse_enum


class Mode(str, enum.Enum):
    """``MOETUNE_MODE``: what the plugin does inside vLLM."""

    OFF = "off"  # install nothing
    LOOKUP = "lookup"  # run table winners; anything wrong with the table -> vLLM's own pick
    STRICT = "strict"  # like lookup, but refuse to start without a usable table for this SKU
    RECORD = "record"  # like lookup, and append every bucket without its own winner to a file


@dataclasses.dataclass(frozen=True)
class Settings:
    """The plugin's settings.

    Attributes:
        mode: ``MOETUNE_MODE`` (default ``lookup``).
        table: ``MOETUNE_TABLE``; None means this machine's adopted table for the detected
            SKU (``moetune adopt``), else the one shipped for it, if any.
        misses: ``MOETUNE_MISSES``, where ``record`` appends missed buckets (JSON lines).
        stats: ``MOETUNE_STATS``, where each process that ran MoE layers writes its counters at
            exit (``{pid}`` in the path is replaced by the process id).
        deterministic: ``MOETUNE_DETERMINISTIC=1``: serve only winners that give the same bits
            in every call (``BaseKernel.run_to_run``), vLLM's own kernel elsewhere, so a rerun
            of the same batches gives the same outputs, as vLLM's own path does.
    """

    mode: Mode = Mode.LOOKUP
    table: Path | None = None
    misses: Path = Path("moetune-misses.jsonl")
    stats: str | None = None
    deterministic: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        """Raises: InvalidProblemError naming the valid values if ``MOETUNE_MODE`` or
        ``MOETUNE_DETERMINISTIC`` has another."""
        try:
            mode = parse_enum(Mode, env.get("MOETUNE_MODE") or Mode.LOOKUP.value)
        except InvalidProblemError as e:
            raise InvalidProblemError(f"MOETUNE_MODE: {e}") from e
        deterministic = env.get("MOETUNE_DETERMINISTIC") or "0"
        if deterministic not in ("0", "1"):
            raise InvalidProblemError(f"MOETUNE_DETERMINISTIC={deterministic!r}: 0 or 1")
        table = env.get("MOETUNE_TABLE") or None
        return cls(mode=mode, table=Path(table).expanduser() if table else None,
                   misses=Path(env.get("MOETUNE_MISSES") or "moetune-misses.jsonl"),
                   stats=env.get("MOETUNE_STATS") or None, deterministic=deterministic == "1")
