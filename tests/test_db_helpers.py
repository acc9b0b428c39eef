"""Builders shared by the ``test_db_*`` files: real table files written through the public API."""

import os
from pathlib import Path
from typing import Any

from moetune.db import (
    MeasurementStatus,
    RunStatus,
    add_measurement,
    finish_run,
    get_or_create_bucket,
    get_or_create_sku,
    set_winner,
    start_run,
    write_table,
)

H200 = ("nvidia", "H200", "sm_90", 132, 150_754_820_096)
MI300X = ("amd", "MI300X", "gfx942", 304, 205_822_885_888)
ENVIRONMENT = {
    "torch": "2.9.0", "triton": "3.5.0", "cuda": "12.8", "hip": None, "aiter": None, "vllm": None,
}


def files_in(directory: Path) -> list[str]:
    """The names in ``directory``, sorted: what a test of leftover files looks at (lock files
    included: they live outside the table's folder)."""
    return sorted(os.listdir(directory))


def bucket_key(**changes: Any) -> dict[str, Any]:
    """A Mixtral-8x7B-like bucket key, with ``changes`` applied."""
    key = {
        "num_tokens": 64, "hidden_size": 4096, "intermediate_size": 14336, "num_experts": 8,
        "topk": 2, "dtype": "bfloat16", "quant": "none", "activation": "silu", "gated": True,
        "router_weight_on_input": False,
    }
    return {**key, **changes}


def tune(
    path: Path,
    *,
    num_tokens: int = 64,
    kernel: str = "triton",
    params: dict[str, Any] | None = None,
    median: float = 10.0,
    spread: float = 1.0,
    baseline: float = 15.0,
    rule_params: dict[str, Any] | None = None,
    sku: tuple = H200,
    failed_trials: int = 1,
) -> None:
    """One finished tuning run that measures ``kernel`` on one bucket and makes it the winner.

    Each call is a new run; ``failed_trials`` extra failed measurements are recorded too.
    """
    params = {"BLOCK_M": 16, "num_warps": 4} if params is None else params
    with write_table(path) as table, table.session() as session:
        sku_row = get_or_create_sku(session, *sku)
        bucket = get_or_create_bucket(session, **bucket_key(num_tokens=num_tokens))
        run = start_run(session, sku_row, ENVIRONMENT, "moetune tune", "abc123", "570.86")
        add_measurement(session, run, bucket, kernel, params, median, median - spread,
                        median + spread, 50, 1e-3, MeasurementStatus.OK, None)
        for i in range(failed_trials):
            add_measurement(session, run, bucket, kernel, {**params, "BLOCK_M": 1024 + i}, None,
                            None, None, 0, None, MeasurementStatus.FAILED, "out of resources")
        set_winner(session, sku_row, bucket, run, kernel, params, median, median - spread,
                   median + spread, 1e-3, "rule", rule_params or {}, baseline)
        finish_run(session, run, RunStatus.FINISHED)
