"""``scripts/flashinfer_build_cost.py``'s projection: units grouped by kind (a generated file's
name less its group number), each kind's mean time times its units."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import flashinfer_build_cost as cost  # noqa: E402

GEN = "/x/cutlass_kernel_file_gemm_sm90_M128_group{}.generated.cu"


def test_generated_units_group_by_kind_and_sources_stand_alone():
    assert cost.kind(GEN.format(1)) == cost.kind(GEN.format(27)) == \
        "cutlass_kernel_file_gemm_sm90_M128"
    assert cost.kind("/y/moe_gemm_kernels_bf16_bf16.cu") == "moe_gemm_kernels_bf16_bf16.cu"


def test_the_projection_counts_every_unit_of_a_kind_at_its_mean():
    units = [{"file": GEN.format(i)} for i in range(10)] + [{"file": "/y/a.cu"}]
    timed = [{"kind": cost.kind(GEN.format(0)), "s": 100.0},
             {"kind": cost.kind(GEN.format(1)), "s": 200.0},
             {"kind": "a.cu", "s": 60.0}]
    text = cost.report(units, timed, jobs=1, cores=10)
    assert "| cutlass_kernel_file_gemm_sm90_M128 | 10 | 100, 200 | 25.0 |" in text
    assert "| a.cu | 1 | 60 | 1.0 |" in text
    # 10 x 150 s + 60 s = 1560 s: 0.43 CPU-hours, 3 minutes on 10 cores.
    assert "Projected: 0.43 CPU-hours; at best 3 minutes on 10 cores" in text
