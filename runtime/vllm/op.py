"""``moetune::experts_apply``: the per-call choice as an opaque torch op, for traced MoE layers.

On CUDA and ROCm vLLM runs each MoE layer inside its own opaque custom op, so the hook's Python
runs eagerly even in a compiled model. On the CPU vLLM calls the layer directly and Dynamo traces
into the experts' ``apply`` (with ``fullgraph``), where dict lookups, counters and kernel
objects cannot go. There the hook calls this op instead: the compiled graph holds one opaque
call per layer, and its body (``LayerPlan.run``, eager) picks the kernel for each num_tokens.

No ``from __future__ import annotations`` here: ``torch.library`` reads the annotations.
"""

import threading
from collections.abc import Callable
from typing import Any

import torch

_RUNS: list[Callable[..., Any]] = []
_LOCK = threading.Lock()
_REGISTERED = False


def bind(run: Callable[..., Any]) -> int:
    """Make ``run`` (a layer's ``LayerPlan.run``) callable through the op; returns its id."""
    with _LOCK:
        _RUNS.append(run)
        return len(_RUNS) - 1


def ensure_registered() -> None:
    """Define the op once per process (idempotent)."""
    global _REGISTERED
    with _LOCK:
        if _REGISTERED:
            return

        @torch.library.custom_op("moetune::experts_apply", mutates_args=("output",))
        def experts_apply(output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
                          w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None,
                          a2_scale: torch.Tensor | None, workspace13: torch.Tensor,
                          workspace2: torch.Tensor, global_num_experts: int,
                          apply_router_weight_on_input: bool, op_id: int) -> None:
            _RUNS[op_id](output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map,
                         a1q_scale, a2_scale, workspace13, workspace2, global_num_experts,
                         apply_router_weight_on_input)

        @experts_apply.register_fake
        def _(output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map, a1q_scale,
              a2_scale, workspace13, workspace2, global_num_experts,
              apply_router_weight_on_input, op_id) -> None:
            return None

        _REGISTERED = True
