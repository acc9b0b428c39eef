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


def test_a_whole_build_reads_from_its_ninja_log(tmp_path):
    """A resumed build logs an object again: its last entry counts; the link is no unit."""
    gen = "cutlass_kernel_file_gemm_sm90_M128_group{}.generated.cuda.o"
    entries = [(0, 90, gen.format(1)), (0, 50, gen.format(2)), (0, 120, gen.format(2)),
               (10, 160, "moe_gemm_moe_gemm_kernels_bf16_bf16.cuda.o"),
               (160, 170, "fused_moe_90.so")]
    (tmp_path / ".ninja_log").write_text("# ninja log v7\n" + "".join(
        f"{start * 1000}\t{end * 1000}\t1\t/ws/fused_moe_90/{out}\th\n"
        for start, end, out in entries))
    units = cost.from_ninja_log(tmp_path / ".ninja_log")
    assert sorted((u["kind"], u["s"]) for u in units) == [
        ("cutlass_kernel_file_gemm_sm90_M128", 90.0), ("cutlass_kernel_file_gemm_sm90_M128", 120.0),
        ("moe_gemm_moe_gemm_kernels_bf16_bf16.cu", 150.0)]
    text = cost.report(units, units, jobs=0, cores=2)
    assert "times from the build's ninja log" in text
    assert "| cutlass_kernel_file_gemm_sm90_M128 | 2 | 90, 120 | 3.5 |" in text
    # 90 + 120 + 150 = 360 s: 0.10 CPU-hours, at best 3 minutes on 2 cores.
    assert "Projected: 0.10 CPU-hours; at best 3 minutes on 2 cores" in text
