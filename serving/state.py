"""The vLLM plugin's per-process state: the table, the plans built from it, counters, misses.

One ``PluginState`` per process, built by ``register()`` and filled lazily: the table is read
when the first MoE layer of this process asks for it (in vLLM's worker), never at import time;
each (shape, layout) gets its ``ShapePlan`` when its first layer attaches. Nothing here imports
vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from moetune.errors import TableError
from moetune.runtime.kernels.base import WeightLayout
from moetune.runtime.problem import MoEProblem, Shape
from moetune.runtime.plan import Outcome, ShapePlan
from moetune.runtime.vllm.versions import VllmFacts, installed_facts
from moetune.serving.misses import MissLog
from moetune.serving.settings import Mode, Settings

logger = logging.getLogger("moetune")


def shape_label(shape: Shape) -> str:
    """A readable, JSON-safe key for counters: the problem description without num_tokens."""
    return shape.problem(1).describe().removeprefix("M=1 ")


class PluginState:
    """Settings, the loaded dispatcher, the plans, counters and missed buckets of one process.

    Thread safety: counters are plain dict increments under the GIL; the table load and the
    plan cache are guarded by a lock (both happen once per process or layer, never per call).
    """

    def __init__(self, settings: Settings, vllm: VllmFacts | None = None) -> None:
        self.settings = settings
        #: The facts of the vLLM serving here (what its experts' ``apply`` computes).
        self.vllm = vllm or installed_facts()
        self.counts: dict[str, dict[str, int]] = {}
        self.layers = 0
        self.plain_copy_bytes = 0
        self.misses = MissLog(settings.misses)
        self._dispatcher: Any = None
        self._plans: dict[tuple[Shape, WeightLayout], ShapePlan] = {}
        self._announced: set[tuple[str, ...]] = set()
        self._lock = threading.Lock()
        self._exit_hooked = False
        self._reported = False
        os.register_at_fork(after_in_child=self._forget_parent)

    def _forget_parent(self) -> None:
        """In a forked child: its own counters, misses and exit hook (table and plans stay)."""
        self.counts, self.layers, self.plain_copy_bytes = {}, 0, 0
        self.misses = MissLog(self.settings.misses)
        self._announced = set()
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
        """The process's dispatcher, loaded on first use with one log line (``strict`` judges
        every row then; otherwise ``plan`` warns about each faulty row of its shape).

        Raises:
            TableError: in ``strict`` mode, if the table is missing, invalid, for another SKU,
                or has faulty rows.
        """
        if self._dispatcher is None:
            with self._lock:
                if self._dispatcher is None:
                    self._dispatcher = self._load()
        return self._dispatcher

    def _load(self) -> Any:
        from moetune.runtime.dispatcher import Dispatcher, default_table
        from moetune.runtime.platform import detect_sku

        sku = detect_sku("auto")
        path = self.settings.table or default_table(sku)
        dispatcher = Dispatcher.load(path, sku)
        mode = self.settings.mode.value
        strict = self.settings.mode is Mode.STRICT
        if dispatcher.usable and not strict:  # rows are judged per shape: see ``plan``
            logger.info("moetune: mode %s, table %s: %d rows, SKU %s matches; a shape's rows "
                        "are checked when its first layer attaches, and the stats count those "
                        "served (pid %d)", mode, path, dispatcher.table_rows, sku.label(),
                        os.getpid())
            return dispatcher
        st = dispatcher.status  # strict: every row judged now, to refuse a faulty table
        if st.usable and st.faulty_rows:
            raise TableError(
                f"moetune (MOETUNE_MODE=strict) refuses to start: table {st.path} has "
                f"{len(st.faulty_rows)} faulty row{'s' if len(st.faulty_rows) > 1 else ''}: "
                f"{'; '.join(st.faulty_rows)}. Re-tune or "
                "re-import those buckets, or set MOETUNE_MODE=lookup (they fall back).")
        if st.usable:
            rejected = f", {len(st.rejected_rows)} rows rejected" if st.rejected_rows else ""
            logger.info("moetune: mode %s, table %s: %d rows, SKU %s matches%s (pid %d)",
                        mode, st.path, st.rows, sku.label(), rejected, os.getpid())
        elif strict:
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

    def plan(self, shape: Shape, layout: WeightLayout) -> ShapePlan:
        """The shared plan of every layer of ``shape`` holding ``layout``, built on first use
        (the shape's first also warns about each of its faulty rows).

        Raises:
            TableError: as ``dispatcher``.
        """
        key = (shape, layout)
        plan = self._plans.get(key)
        if plan is None:
            dispatcher = self.dispatcher()
            with self._lock:
                plan = self._plans.get(key)
                if plan is None:
                    if all(s != shape for s, _ in self._plans):  # the shape's first plan
                        for row in dispatcher.faulty_rows(shape):
                            logger.warning("moetune: table %s: %s; vLLM's own kernel runs for "
                                           "that bucket (counted as fallback)",
                                           dispatcher.path, row)
                    plan = self._plans[key] = ShapePlan.build(
                        dispatcher, shape, layout, self.settings.deterministic)
        return plan

    # --- counting and recording --------------------------------------------------------------
    def counter(self, shape: Shape | str, delegates: bool = False) -> dict[str, int]:
        """The live counter dict of a shape (a label for layers moetune cannot describe);
        ``delegates``: it counts ``Outcome.DELEGATED`` calls too."""
        label = shape if isinstance(shape, str) else shape_label(shape)
        counts = self.counts.setdefault(
            label, {o.value: 0 for o in Outcome if o is not Outcome.DELEGATED})
        if delegates:
            counts.setdefault(Outcome.DELEGATED.value, 0)
        return counts

    def record_miss(self, problem: MoEProblem) -> None:
        """Remember ``problem``'s bucket for the misses file (``record`` mode only; no I/O)."""
        if self.settings.mode is Mode.RECORD:
            self.misses.add(problem)

    def announce(self, key: tuple[str, ...], message: str, *args: Any) -> None:
        """Log ``message`` once per ``key`` in this process (the startup line of a layer kind)."""
        with self._lock:
            if key in self._announced:
                return
            self._announced.add(key)
        logger.info(message, *args)

    # --- reporting ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything a test or an operator wants to know, as plain JSON-able values."""
        st = self._dispatcher.status if self._dispatcher is not None else None
        return {
            "pid": os.getpid(),
            "mode": self.settings.mode.value,
            "table": None if st is None else {"path": st.path, "usable": st.usable,
                                              "reason": st.reason, "rows": st.rows,
                                              "rows_for_sku": self._dispatcher.table_rows},
            "layers": self.layers,
            "plain_copy_bytes": self.plain_copy_bytes,
            "counters": {k: dict(v) for k, v in self.counts.items()},
        }

    def report(self) -> None:
        """At exit: the missed buckets (``record``), one log line per shape, and the stats file
        if ``MOETUNE_STATS`` is set."""
        if not self.counts or self._reported:
            return
        self._reported = True
        self.misses.flush()
        for label, c in self.counts.items():
            delegated = c.get(Outcome.DELEGATED.value)
            logger.info("moetune: %s: %d hits, %d misses, %d fallbacks%s", label,
                        c["hit"], c["miss"], c["fallback"],
                        "" if delegated is None else f", {delegated} run by DeepGEMM")
        if self.settings.stats:
            path = Path(self.settings.stats.replace("{pid}", str(os.getpid())))
            try:
                path.write_text(json.dumps(self.snapshot(), indent=1), encoding="utf-8")
            except OSError as e:
                logger.warning("moetune: cannot write stats to %s: %s", path, e)
