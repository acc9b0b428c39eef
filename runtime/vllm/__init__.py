"""Every vLLM fact moetune relies on, behind one adapter: the plugin, its hook, its state."""

from moetune.runtime.vllm.plugin import counters, register, stats

__all__ = ["counters", "register", "stats"]
