"""Every vLLM fact moetune relies on, behind one adapter: the plugin, its hook, its state, and
the configs vLLM's Triton kernel runs (``configs``, which the CUDA rule reads without vLLM).

The plugin's functions load on first use, so the rule can read ``configs`` without importing the
plugin (and the plugin's import of the rule cannot cycle back here).
"""

from __future__ import annotations

from typing import Any

__all__ = ["counters", "register", "stats"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from moetune.runtime.vllm import plugin

        return getattr(plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
