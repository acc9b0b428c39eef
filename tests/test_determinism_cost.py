"""``scripts/determinism_cost.py`` on the shipped H100 table: what its searches say a table of
deterministic winners keeps."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import determinism_cost  # noqa: E402

from moetune import db  # noqa: E402


def test_deterministic_trials_are_picked_and_atomics_won_only_above_top_2():
    table = ROOT / "runtime/tables/nvidia_H100_80GB_HBM3.db"
    rows = determinism_cost.bucket_rows(table)
    assert len(rows) == len(db.read_winners(table).rows)  # one per bucket with a winner
    assert all(determinism_cost.varies(r["steady"]) is None for r in rows)
    top8 = [r for r in rows if "topk=8" in r["shape"]]
    assert any(determinism_cost.varies(r["best"]) for r in top8)  # atomics won there
    assert all(r["best"] is r["steady"] for r in rows if "topk=8" not in r["shape"])
    assert all(r["steady"]["median_us"] >= r["best"]["median_us"] for r in rows)
    text = determinism_cost.report(table)
    assert text.count("\n| 4096 |") == 5  # each preset's largest bucket
