"""The vLLM plugin's per-process state: settings from the environment, the table, counters, misses.

One ``PluginState`` per process, built by ``register()`` and filled lazily: the table is read
when the first MoE layer of this process asks for it (in vLLM's worker), never at import time.
Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moetune.errors import TableError
from moetune.runtime.problem import MoEProblem, Shape, parse_enum

logger = logging.getLogger("moetune")



class Mode(str, enum.Enum):
    """``MOETUNE_MODE``: what the plugin does inside vLLM."""

    OFF = "off"  # install nothing
    LOOKUP = "lookup"  # run table winners; anything wrong with the table -> vLLM's own pick
    STRICT = "strict"  # like lookup, but refuse to start without a usable table for this SKU
    RECORD = "record"  # like lookup, and append every bucket without its own winner to a file


class Outcome(str, enum.Enum):
    """What one MoE call ran. Counted per layer shape."""

    HIT = "hit"  # the table's winner ran (vLLM's own kernel, when that is the winner)
    MISS = "miss"  # no table row for this shape (or no usable table): vLLM's own kernel ran
    FALLBACK = "fallback"  # the table had a winner that cannot run here: vLLM's kernel ran


@dataclasses.dataclass(frozen=True)
class Settings:
    """The plugin's settings, read once per process from the environment.

    Attributes:
        mode: ``MOETUNE_MODE`` (default ``lookup``).
        table: ``MOETUNE_TABLE``; None means the table shipped for the detected SKU, if any.
        misses: ``MOETUNE_MISSES``, where ``record`` appends missed buckets (JSON lines).
        stats: ``MOETUNE_STATS``, where each process that ran MoE layers writes its counters at
            exit (``{pid}`` in the path is replaced by the process id).
    """

    mode: Mode = Mode.LOOKUP
    table: Path | None = None
    misses: Path = Path("moetune-misses.jsonl")
    stats: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        """Raises: InvalidProblemError naming the valid modes if ``MOETUNE_MODE`` is unknown."""
        mode = parse_enum(Mode, env.get("MOETUNE_MODE") or Mode.LOOKUP.value)
        table = env.get("MOETUNE_TABLE") or None
        return cls(mode=mode, table=Path(table).expanduser() if table else None,
                   misses=Path(env.get("MOETUNE_MISSES") or "moetune-misses.jsonl"),
                   stats=env.get("MOETUNE_STATS") or None)


def shape_label(shape: Shape) -> str:
    """A readable, JSON-safe key for counters: the problem description without num_tokens."""
    return shape.problem(1).describe().removeprefix("M=1 ")


class PluginState:
    """Settings, the loaded dispatcher, counters and recorded misses of one process.

    Thread safety: counters are plain dict increments under the GIL; the table load and the
    misses file are guarded by a lock (both happen once per layer or bucket, never per call).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.counts: dict[str, dict[str, int]] = {}
        self.layers = 0
        self.plain_copy_bytes = 0
        self._dispatcher: Any = None
        self._lock = threading.Lock()
        self._recorded: set[str] | None = None
        self._exit_hooked = False
        self._reported = False
        os.register_at_fork(after_in_child=self._forget_parent)

    def _forget_parent(self) -> None:
        """In a forked child: its own counters and exit hook (the table stays loaded)."""
        self.counts, self.layers, self.plain_copy_bytes = {}, 0, 0
        self._lock = threading.Lock()
        self._exit_hooked = self._reported = False

    def hook_exit(self) -> None:
        """Report at this process's exit; called by the first layer of the process.

        Both hooks are needed: ``atexit`` covers the main process and spawned children, while
        children of a forked ``multiprocessing`` process leave through ``os._exit`` and only
        run multiprocessing's finalizers (registered here, after that process cleared them).
        """
        if self._exit_hooked:
            return
        self._exit_hooked = True
        import atexit
        import multiprocessing.util

        atexit.register(self.report)
        multiprocessing.util.Finalize(None, self.report, exitpriority=10)

    # --- the table -------------------------------------------------------------------------
    def dispatcher(self) -> Any:
        """The process's dispatcher, loaded on first use with one log line.

        Raises:
            TableError: in ``strict`` mode, if the table is missing, invalid or for another SKU.
        """
        if self._dispatcher is None:
            with self._lock:
                if self._dispatcher is None:
                    self._dispatcher = self._load()
        return self._dispatcher

    def _load(self) -> Any:
        from moetune.runtime.dispatcher import Dispatcher, shipped_table
        from moetune.runtime.platform import detect_sku

        sku = detect_sku("auto")
        path = self.settings.table
        if path is None and shipped_table(sku).is_file():
            path = shipped_table(sku)
        dispatcher = Dispatcher.load(path, sku)
        st = dispatcher.status
        mode = self.settings.mode.value
        if st.usable:
            rejected = f", {len(st.rejected_rows)} rows rejected" if st.rejected_rows else ""
            logger.info("moetune: mode %s, table %s: %d rows, SKU %s matches%s (pid %d)",
                        mode, st.path, st.rows, sku.label(), rejected, os.getpid())
        elif self.settings.mode is Mode.STRICT:
            raise TableError(
                f"moetune (MOETUNE_MODE=strict) refuses to start: table {st.path or '(none)'} "
                f"is not usable here: {st.reason}. Point MOETUNE_TABLE at a table tuned for "
                "this device (moetune tune ...) or set MOETUNE_MODE=lookup.")
        else:
            logger.warning("moetune: mode %s, table %s not used (%s); vLLM's own MoE kernels "
                           "run (pid %d)", mode, st.path or "(none)", st.reason, os.getpid())
        return dispatcher

    def check_strict(self) -> None:
        """In ``strict`` mode, fail now (not at the first layer) when that can be known now.

        Raises:
            TableError: the table file is missing; or, on a machine without a GPU (where the
                SKU is known without touching a device), it is invalid or for another SKU.
        """
        if self.settings.mode is not Mode.STRICT:
            return
        path = self.settings.table
        if path is not None and not path.is_file():
            raise TableError(f"moetune (MOETUNE_MODE=strict) refuses to start: MOETUNE_TABLE "
                             f"{path} does not exist.")
        import torch

        if not torch.cuda.is_available():
            self.dispatcher()

    # --- counting and recording --------------------------------------------------------------
    def counter(self, shape: Shape | str) -> dict[str, int]:
        """The live counter dict of a shape (a label for layers moetune cannot describe)."""
        label = shape if isinstance(shape, str) else shape_label(shape)
        return self.counts.setdefault(label, {o.value: 0 for o in Outcome})

    def record_miss(self, problem: MoEProblem) -> None:
        """Append ``problem``'s bucket to the misses file once (``record`` mode only)."""
        if self.settings.mode is not Mode.RECORD:
            return
        line = json.dumps(problem.bucket().to_row(), sort_keys=True)
        with self._lock:
            if self._recorded is None:
                self._recorded = _existing_lines(self.settings.misses)
            if line in self._recorded:
                return
            self._recorded.add(line)
            try:
                self.settings.misses.parent.mkdir(parents=True, exist_ok=True)
                with open(self.settings.misses, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
            except OSError as e:
                logger.warning("moetune: cannot record a missed bucket to %s: %s",
                               self.settings.misses, e)

    # --- reporting ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything a test or an operator wants to know, as plain JSON-able values."""
        st = self._dispatcher.status if self._dispatcher is not None else None
        return {
            "pid": os.getpid(),
            "mode": self.settings.mode.value,
            "table": None if st is None else {"path": st.path, "usable": st.usable,
                                              "reason": st.reason, "rows": st.rows},
            "layers": self.layers,
            "plain_copy_bytes": self.plain_copy_bytes,
            "counters": {k: dict(v) for k, v in self.counts.items()},
        }

    def report(self) -> None:
        """At exit: one log line per shape, and the stats file if ``MOETUNE_STATS`` is set."""
        if not self.counts or self._reported:
            return
        self._reported = True
        for label, c in self.counts.items():
            logger.info("moetune: %s: %d hits, %d misses, %d fallbacks", label,
                        c["hit"], c["miss"], c["fallback"])
        if self.settings.stats:
            path = Path(self.settings.stats.replace("{pid}", str(os.getpid())))
            try:
                path.write_text(json.dumps(self.snapshot(), indent=1), encoding="utf-8")
            except OSError as e:
                logger.warning("moetune: cannot write stats to %s: %s", path, e)


def _existing_lines(path: Path) -> set[str]:
    """Lines already in the misses file, normalised, so reruns do not append duplicates."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return set()
    lines = set()
    for raw in text.splitlines():
        try:
            lines.add(json.dumps(json.loads(raw), sort_keys=True))
        except ValueError:
            continue
    return lines
