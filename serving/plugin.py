"""moetune's vLLM plugin: ``register()``, the ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` in every process it starts (the API process, the engine core, each
worker), possibly more than once; the second and later calls do nothing. Importing this module
does nothing either: settings are read, and vLLM's MoE experts hooked (``hook``), inside
``register()``; the table is read when the first MoE layer of a process needs it.

Settings (environment):
    MOETUNE_MODE    off | lookup (default) | strict | record
    MOETUNE_DETERMINISTIC
                    1: serve only winners whose bits are the same in every call (no atomics
                    adding more than two values), vLLM's own kernel elsewhere; default 0
    MOETUNE_TABLE   table file; default this machine's adopted table for this SKU
                    (``moetune adopt``), else ``runtime/tables/<vendor>_<name>.db``
    MOETUNE_HOME    where adopted tables live (default ``~/.local/share/moetune``)
    MOETUNE_MISSES  where ``record`` appends missed buckets (default moetune-misses.jsonl)
    MOETUNE_STATS   where each process that ran MoE layers writes its counters at exit
                    (``{pid}`` is replaced by the process id)

Anything wrong with the table, a vLLM outside ``versions.FACTS``, vLLM internals that differ
or vLLM asked for batch-invariant outputs (``VLLM_BATCH_INVARIANT=1``) leave vLLM serving with
its own kernels and one warning; only ``strict`` refuses to start, with a ``TableError`` saying
why.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from moetune.errors import MoetuneError, TableError

logger = logging.getLogger("moetune")

_STATE: Any = None  # the process's PluginState once register() ran
_REGISTERED = False


def register() -> None:
    """Hook vLLM's MoE experts so each call runs the table's winner for its bucket.

    Raises:
        TableError: ``MOETUNE_MODE=strict`` and the table is missing, invalid or for another
            SKU (checked here where that is known without a device, else at the first layer).
    """
    global _STATE, _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    _ensure_log_handler()
    from moetune.runtime.vllm import classes, versions
    from moetune.serving import hook
    from moetune.serving.settings import Mode, Settings
    from moetune.serving.state import PluginState

    try:
        settings = Settings.from_env()
    except MoetuneError as e:
        logger.warning("moetune: disabled: %s", e)
        return
    if settings.mode is Mode.OFF:
        logger.info("moetune: MOETUNE_MODE=off, vLLM's own MoE kernels run (pid %d)", os.getpid())
        return
    state = PluginState(settings)
    state.check_strict()
    vllm = versions.installed()
    aside = versions.aside(vllm)
    if aside:
        _disable(settings.mode is Mode.STRICT, aside, None)
        return
    try:
        hooked = hook.install(state, classes.platform_specs())
    except Exception as e:  # whatever differs in vLLM, serving goes on
        _disable(settings.mode is Mode.STRICT, f"vLLM {vllm} differs from what moetune knows "
                 f"({e})", e)
        return
    _STATE = state
    logger.info("moetune: hooked %s of vLLM %s, mode %s%s, table %s (read at the first MoE "
                "layer; pid %d)", ", ".join(hooked), vllm, settings.mode.value,
                ", deterministic winners only" if settings.deterministic else "",
                settings.table or "adopted or shipped for this SKU", os.getpid())


def _disable(strict: bool, why: str, error: Exception | None) -> None:
    """One warning, and vLLM runs its own kernels; ``strict`` refuses to start instead.

    Raises:
        TableError: in ``strict`` mode, saying why no table would be used.
    """
    if strict:
        raise TableError(f"moetune (MOETUNE_MODE=strict) refuses to start: {why}, so no table "
                         "would be used.") from error
    logger.warning("moetune: disabled: %s; vLLM's own MoE kernels run", why)


def counters() -> dict[str, dict[str, int]]:
    """Hits, misses and fallbacks so far in this process, per layer shape (a copy)."""
    return {} if _STATE is None else {k: dict(v) for k, v in _STATE.counts.items()}


def stats() -> dict[str, Any]:
    """The counters plus mode, table status and layer count of this process."""
    return {} if _STATE is None else _STATE.snapshot()


def _ensure_log_handler() -> None:
    """vLLM configures only its own logger; give ``moetune`` a handler unless someone did."""
    log = logging.getLogger("moetune")
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [moetune] %(message)s",
                                           "%m-%d %H:%M:%S"))
    log.addHandler(handler)
    log.propagate = False
    if log.level == logging.NOTSET:
        log.setLevel(os.environ.get("MOETUNE_LOG_LEVEL", "INFO").upper())
