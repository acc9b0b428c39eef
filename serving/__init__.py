"""moetune inside vLLM: the ``vllm.general_plugins`` entry point, its hook on vLLM's MoE experts
classes and the per-layer state it keeps. Nothing below this package imports it."""

from moetune.serving.plugin import counters, register, stats

__all__ = ["counters", "register", "stats"]
