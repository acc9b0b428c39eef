"""``moetune_grouped`` (the prefill kernel: grouped GEMMs, the top-k reduce fused) and
``moetune_grouped_mm`` (torch's grouped GEMMs with Triton passes between them) through Triton's
interpreter on this CPU (``tests/interpreted.py``), and their eligibility and constraints."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetune.errors import InvalidParamsError
from moetune.runtime.kernels.triton_config import with_prefix
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import default_registry
from moetune.tuner.gate import relative_error
from moetune.tuner.inputs import make_batch, make_weights
from tests.interpreted import (GROUPED, H100, TILE, TOLERANCE, case_id, check_own_triton_devices,
                               checks_pass_in_a_fresh_process, needs_triton, outer_run, prepared)

pytestmark = needs_triton

grouped_interpreted = pytest.mark.fresh_process("TRITON_INTERPRET", "MOETUNE_GROUPED_CHECKS")
# Every reduce, top-1 (a direct store), the router weight on the input, ungated GELU, a GEMM2
# tile of other rows (routing aligned twice), a GROUP_SIZE_M that reorders tiles, and tails:
# H=72 and I=40 are multiples of no tile; 7 tokens x 3 slots leave padded rows in every block.
# GEMM2 programs of several H tiles: H=72 in 3 tiles, 2 per program (the last half empty),
# I=32 in one K step (every step ends a tile), and top-1's store. Weight tiles through TMA
# descriptors: tiles past H and I (zeros from the descriptor, or the next rows of the weight,
# whose columns are never stored), with each reduce, several H tiles, top-1 and ungated. Gate
# and up tiles in one box (``g1_PAIR_TMA``): I=40 leaves the last tile of each half part empty
# (zeros from the descriptor), with the router weight on the input and per-row tiles reordered.
# GEMM2 programs in column-major order (``g2_N_MAJOR``): several row blocks per column group
# (9 x 3 pairs in blocks of 16), with a GEMM2 tile of other rows, two tiles per program (the
# last half empty), through TMA, and top-1. GEMM2 on a persistent grid (``g2_PERSISTENT``: two
# programs here, each walking several tiles): every reduce, column-major order, a GEMM2 tile of
# other rows, TMA, top-1 on input, I=32 in one K step (every step ends a tile), and units of two
# column tiles (H=72: the second tile of the last unit lies past H). GEMM2's activation tiles
# through TMA (``g2_A_TMA``: the intermediate in sorted order, padded rows never written): each
# reduce, top-1 on input, I=40 past the last K step (zeros from the descriptor), several K steps
# per tile in a loop of two tiles, and the persistent grid.
GROUPED_CASES = [
    (MoEProblem(5, 64, 32, 8, 2, dtype="float32"), {}),
    (MoEProblem(5, 64, 32, 8, 2, dtype="float32"), {"REDUCE": "sum"}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"), {"REDUCE": "atomic_out"}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"), {"g2_BLOCK_SIZE_M": 32, "REDUCE": "sum"}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"), {"g1_GROUP_SIZE_M": 16, "g2_BLOCK_SIZE_N": 64}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True), {}),
    (MoEProblem(6, 64, 48, 8, 2, dtype="float32", activation="gelu", gated=False),
     {"REDUCE": "sum"}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"), {"g2_N_TILES": 2, "REDUCE": "atomic_out"}),
    (MoEProblem(5, 64, 32, 8, 2, dtype="float32"), {"g2_N_TILES": 2, "REDUCE": "sum"}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     {"g2_N_TILES": 2}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"), {"W_TMA": 1, "REDUCE": "atomic_out"}),
    (MoEProblem(5, 64, 32, 8, 2, dtype="float32"), {"W_TMA": 1, "g2_N_TILES": 2, "REDUCE": "sum"}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True), {"W_TMA": 1}),
    (MoEProblem(6, 64, 48, 8, 2, dtype="float32", activation="gelu", gated=False), {"W_TMA": 1}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"),
     {"W_TMA": 1, "g1_PAIR_TMA": 1, "REDUCE": "atomic_out"}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     {"W_TMA": 1, "g1_PAIR_TMA": 1, "g1_GROUP_SIZE_M": 16}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"), {"g2_N_MAJOR": 1, "REDUCE": "atomic_out"}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"),
     {"g2_N_MAJOR": 1, "g2_BLOCK_SIZE_M": 32, "g2_N_TILES": 2, "W_TMA": 1, "REDUCE": "sum"}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     {"g2_N_MAJOR": 1}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"), {"g2_PERSISTENT": 2, "REDUCE": "atomic_out"}),
    (MoEProblem(5, 64, 32, 8, 2, dtype="float32"), {"g2_PERSISTENT": 2, "REDUCE": "sum"}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"),
     {"g2_PERSISTENT": 2, "g2_N_TILES": 2, "REDUCE": "atomic_out"}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"),
     {"g2_PERSISTENT": 2, "g2_N_TILES": 2, "g2_N_MAJOR": 1, "W_TMA": 1}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"),
     {"g2_PERSISTENT": 4, "g2_N_MAJOR": 1, "g2_BLOCK_SIZE_M": 32, "W_TMA": 1}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     {"g2_PERSISTENT": 4, "g1_GROUP_SIZE_M": 16, "g2_GROUP_SIZE_M": 16}),
    (MoEProblem(7, 72, 40, 4, 3, dtype="float16"), {"g2_A_TMA": 1, "REDUCE": "atomic_out"}),
    (MoEProblem(5, 64, 32, 8, 2, dtype="float32"), {"g2_A_TMA": 1, "REDUCE": "sum"}),
    (MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     {"g2_A_TMA": 1, "W_TMA": 1}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"),
     {"g2_A_TMA": 1, "g2_N_TILES": 2, "g2_N_MAJOR": 1}),
    (MoEProblem(9, 72, 40, 4, 3, dtype="float16"),
     {"g2_A_TMA": 1, "g2_PERSISTENT": 2, "g2_N_TILES": 2, "W_TMA": 1}),
]


@outer_run
def test_grouped_checks_pass_in_a_fresh_process():
    checks_pass_in_a_fresh_process(__file__, "MOETUNE_GROUPED_CHECKS", "grouped",
                                   len(GROUPED_CASES) + 2 + len(FP8_OUT_CASES))


@grouped_interpreted
@pytest.mark.parametrize("problem,override", GROUPED_CASES, ids=case_id)
def test_grouped_kernel_matches_reference_interpreted(problem, override, cpu_sku):
    fn, batch, ref = prepared("moetune_grouped", {**GROUPED, **override}, problem, cpu_sku)
    out = torch.full_like(batch.x, float("nan"))
    assert fn(*batch.args(), out=out) is out
    assert relative_error(out, ref) <= TOLERANCE[problem.dtype.value]


# GEMM1's epilogue writing GEMM2's block-fp8 input (``g1_FP8_OUT``): tiles of one and of two
# 128-column groups (I = 384: the last 256-column tile half past I), with the sorted intermediate
# and paired gate and up tiles, and with vLLM's separate sum over two GEMM2 tiles per program.
FP8_OUT_CASES = [
    {"g1_BLOCK_SIZE_N": 128},
    {"g1_BLOCK_SIZE_N": 256},
    {"g1_BLOCK_SIZE_N": 128, "g2_A_TMA": 1, "W_TMA": 1, "g1_PAIR_TMA": 1},
    {"g1_BLOCK_SIZE_N": 256, "REDUCE": "sum", "g2_N_TILES": 2},
]


@grouped_interpreted
@pytest.mark.parametrize("override", FP8_OUT_CASES, ids=str)
def test_grouped_fp8_epilogue_writes_what_the_separate_quantization_would(override):
    """The interpreter's fp8 rounding is not the GPU's (so fp8 layers are not offered under it,
    and the CUDA tests hold these against the reference): here the fused epilogue is held
    against the separate quantization launch at the same tiles, and both against the
    reference's error level, which a scale written to the wrong row or group exceeds by ten."""
    problem = MoEProblem(7, 256, 384, 8, 3, dtype="float16", quant="fp8_block_128x128")
    kernel = default_registry.get("moetune_grouped")
    params = {**GROUPED, "g2_BLOCK_SIZE_N": 128, "g1_BLOCK_SIZE_K": 64,
              "g2_BLOCK_SIZE_K": 64, **override}
    weights = make_weights(problem, "cpu", seed=1)
    batch = make_batch(problem, "cpu", seed=2)
    ref = default_registry.get("reference").prepare(problem, {}, weights)(*batch.args())
    outs = []
    for fused in (0, 1):
        point = kernel.validate({**params, "g1_FP8_OUT": fused})
        assert kernel.check_params(problem, point) is None
        outs.append(kernel.prepare(problem, point, weights)(*batch.args()))
    separate, fused = outs
    assert relative_error(fused, separate) < 0.03  # fp16 rounding before the separate launch
    assert relative_error(fused, ref) < 1.1 * relative_error(separate, ref) < 0.1


@grouped_interpreted
@pytest.mark.parametrize("reduce", ["atomic_out", "atomic"])
def test_grouped_output_may_be_a_view_of_wider_rows(reduce, cpu_sku):
    """GEMM1 zeroes what GEMM2 adds into row by row at the output's stride: the columns past
    the view keep what they held."""
    problem = MoEProblem(7, 72, 40, 4, 3, dtype="float16")
    fn, batch, ref = prepared("moetune_grouped", {**GROUPED, "REDUCE": reduce}, problem, cpu_sku)
    wide = torch.full((7, 80), float("nan"), dtype=batch.x.dtype)
    out = wide[:, :72]
    assert fn(*batch.args(), out=out) is out
    assert relative_error(out, ref) <= TOLERANCE["float16"]
    assert wide[:, 72:].isnan().all()


@outer_run
def test_grouped_eligibility_names_devices_and_schemes(cpu_sku):
    kernel = default_registry.get("moetune_grouped")
    bf16 = MoEProblem(2048, 2048, 768, 128, 8)
    block = MoEProblem(2048, 7168, 256, 256, 8, quant="fp8_block_128x128")
    check_own_triton_devices(kernel, bf16, block, cpu_sku)


@outer_run
def test_grouped_seeds_fit_every_preset_bucket():
    from moetune.tuner.presets import PRESETS

    kernel = default_registry.get("moetune_grouped")
    for name, spec in PRESETS.items():
        for m in spec.buckets:
            problem = spec.shape.problem(m)
            seed = kernel.seed_params(problem, H100)
            assert seed is not None and kernel.validate(seed) == seed, (name, m, seed)
            assert seed["g1_BLOCK_SIZE_M"] >= 16 and seed["g2_BLOCK_SIZE_M"] >= 16


@outer_run
def test_grouped_rows_stored_before_n_tiles_existed_run_one_tile_per_program():
    kernel = default_registry.get("moetune_grouped")
    older = {k: v for k, v in kernel.seed_params(MoEProblem(2048, 2048, 768, 128, 8), H100).items()
             if k != "g2_N_TILES"}
    assert kernel.validate(older) == {**older, "g2_N_TILES": 1}
    with pytest.raises(InvalidParamsError, match="g2_N_TILES=3"):
        kernel.validate({**older, "g2_N_TILES": 3})


@outer_run
def test_grouped_constraints_drop_what_cannot_fit_or_repeats_another_point():
    kernel = default_registry.get("moetune_grouped")
    qwen3 = MoEProblem(2048, 2048, 768, 128, 8)
    llama4 = MoEProblem(2048, 5120, 1024, 128, 1, quant="fp8_per_channel",
                        router_weight_on_input=True)
    block = MoEProblem(2048, 7168, 256, 256, 8, quant="fp8_block_128x128")
    # Gate and up tiles both stay in shared memory: 2 x (64x128 + 2 x 128x256) x 2 B > 227 KiB,
    # where GEMM2's single weight tile (2 x (64x128 + 128x256) x 2 B) fits.
    big = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 128, "num_stages": 2}
    cases = [
        (qwen3, with_prefix(big, "g1_"), "g1: needs"),
        (qwen3, {"g2_BLOCK_SIZE_M": 8}, "16 rows"),
        (block, {"g1_BLOCK_SIZE_K": 256, "g1_num_stages": 2}, "spans two"),
        (llama4, {"REDUCE": "sum"}, "directly"),  # top-1: nothing to reduce
        (dataclasses.replace(qwen3, dtype="float32"), {**with_prefix(TILE, "g1_"),
                                                       "REDUCE": "atomic_out"}, "float32"),
        (qwen3, {"g2_BLOCK_SIZE_N": 256, "g2_N_TILES": 8}, None),  # 2048 = 8 x 256: all full
        (dataclasses.replace(qwen3, hidden_size=1536), {"g2_BLOCK_SIZE_N": 256, "g2_N_TILES": 8},
         "empty"),
        (qwen3, {"W_TMA": 1}, None),
        # fp8 rows of 2040 elements are 2040 B, not a multiple of 16; in bf16 they are 4080 B.
        (dataclasses.replace(qwen3, hidden_size=2040, quant="fp8_per_channel"), {"W_TMA": 1},
         "aligned"),
        (dataclasses.replace(qwen3, hidden_size=2040), {"W_TMA": 1}, None),
        (qwen3, {"W_TMA": 1, "g1_PAIR_TMA": 1}, None),
        (llama4, {"W_TMA": 1, "g1_PAIR_TMA": 1}, None),
        (qwen3, {"W_TMA": 0, "g1_PAIR_TMA": 1}, "needs W_TMA=1"),
        (dataclasses.replace(qwen3, gated=False, activation="gelu"),
         {"W_TMA": 1, "g1_PAIR_TMA": 1}, "not gated"),
        (block, {"W_TMA": 1, "g1_PAIR_TMA": 1, "g1_BLOCK_SIZE_N": 64}, None),
        (block, {"W_TMA": 1, "g1_PAIR_TMA": 1, "g1_BLOCK_SIZE_N": 128}, None),
        (block, {"W_TMA": 1, "g1_PAIR_TMA": 1, "g1_BLOCK_SIZE_N": 256}, "128-row scale block"),
        (block, {"g2_PERSISTENT": 2, "g2_N_MAJOR": 1}, None),
        (qwen3, {"g2_PERSISTENT": 2, "g2_BLOCK_SIZE_N": 256, "g2_N_TILES": 8}, None),
        (dataclasses.replace(qwen3, hidden_size=1536),
         {"g2_PERSISTENT": 2, "g2_BLOCK_SIZE_N": 256, "g2_N_TILES": 8}, "empty"),
        (block, {"g2_A_TMA": 1}, None),
        (qwen3, {"g2_A_TMA": 1, "g2_BLOCK_SIZE_M": 128, "g1_BLOCK_SIZE_M": 64}, "as they lie"),
        # fp8 rows of I = 200 elements are 200 B, not a multiple of 16; in bf16 400 B.
        (dataclasses.replace(block, intermediate_size=200, quant="fp8_per_channel"),
         {"g2_A_TMA": 1}, "aligned"),
        (dataclasses.replace(qwen3, intermediate_size=200), {"g2_A_TMA": 1}, None),
        (block, {"g1_FP8_OUT": 1, "g1_BLOCK_SIZE_N": 128}, None),
        (block, {"g1_FP8_OUT": 1, "g1_BLOCK_SIZE_N": 256, "g1_PAIR_TMA": 0}, None),
        (block, {"g1_FP8_OUT": 1, "g1_BLOCK_SIZE_N": 64}, "no whole 128-column group"),
        (qwen3, {"g1_FP8_OUT": 1, "g1_BLOCK_SIZE_N": 128}, "only block-fp8"),
        (llama4, {"g1_FP8_OUT": 1, "g1_BLOCK_SIZE_N": 128}, "only block-fp8"),
    ]
    for problem, change, word in cases:
        params = {**kernel.seed_params(dataclasses.replace(problem, dtype="bfloat16"), H100),
                  **change}
        why = kernel.check_params(problem, params)
        assert (why is None) if word is None else (why and word in why), (change, why)
    assert kernel.check_params(qwen3, {**kernel.seed_params(qwen3, H100),
                                       **with_prefix(big, "g2_")}) is None


@outer_run
def test_tma_variant_is_refused_where_the_device_has_no_tma_unit(monkeypatch):
    from moetune.runtime.kernels.triton_config import tma_reason

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    verdicts = {}
    for hip, capability in ((None, (9, 0)), (None, (8, 0)), ("6.4", (9, 4))):
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: capability)
        verdicts[capability] = tma_reason.__wrapped__()
    assert verdicts[(9, 0)] is None
    assert "sm_90" in verdicts[(8, 0)] and "sm_80" in verdicts[(8, 0)]
    assert "ROCm" in verdicts[(9, 4)]
    # moetune_grouped's descriptor loads (weights, GEMM2's activations) say so at that point.
    from moetune.runtime.kernels import moetune_grouped

    monkeypatch.undo()  # a CPU again, but for the reason
    monkeypatch.setattr(moetune_grouped, "tma_reason", lambda: verdicts[(9, 4)])
    kernel = default_registry.get("moetune_grouped")
    problem = MoEProblem(2048, 2048, 768, 128, 8)
    seed = {**kernel.seed_params(problem, H100), "W_TMA": 0, "g1_PAIR_TMA": 0}
    assert kernel.check_params(problem, seed) is None
    for name in ("W_TMA", "g2_A_TMA"):
        why = kernel.check_params(problem, {**seed, name: 1})
        assert why == f"{name}=1: {verdicts[(9, 4)]}"


@outer_run
def test_grouped_takes_over_a_vllm_config_at_the_same_work_per_program():
    kernel = default_registry.get("moetune_grouped")
    qwen3 = MoEProblem(2048, 2048, 768, 128, 8)
    vllm = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
            "num_warps": 8, "num_stages": 4}
    params = kernel.from_gemm_configs(qwen3, vllm, {**vllm, "BLOCK_SIZE_M": 8})
    # GEMM1's 256 columns of gate and up become 128 of each; 4 stages of them would need
    # 4 x (128x64 + 2 x 64x128) x 2 B = 192 KiB: they fit, as do GEMM2's.
    assert params["g1_BLOCK_SIZE_N"] == 128 and params["g2_BLOCK_SIZE_N"] == 256
    assert params["g2_BLOCK_SIZE_M"] == 16 and params["REDUCE"] == "atomic_out"
    assert kernel.check_params(qwen3, params) is None
    # Weight tiles through TMA where the rows allow it (this machine has no GPU to refuse it),
    # by pointers where fp8 rows of 2040 B are not 16-byte aligned.
    assert params["W_TMA"] == 1
    unaligned = dataclasses.replace(qwen3, hidden_size=2040, quant="fp8_per_channel")
    assert kernel.from_gemm_configs(unaligned, vllm, vllm)["W_TMA"] == 0
    # And back: aiter's split family at the same tiles, which the search measures next.
    gemm1, gemm2 = kernel.gemm_configs(qwen3, params)
    assert gemm1 == vllm and gemm2 == {**vllm, "BLOCK_SIZE_M": 16}
    split = default_registry.get("aiter_triton_silu_fused")
    assert split.gemm_configs(qwen3, split.from_gemm_configs(qwen3, gemm1, gemm2)) == (gemm1, gemm2)
    assert default_registry.get("aiter_triton").from_gemm_configs(qwen3, gemm1, gemm2) is None
    ungated = dataclasses.replace(qwen3, activation="gelu", gated=False, dtype="float32")
    params = kernel.from_gemm_configs(ungated, vllm, vllm)
    assert params["g1_BLOCK_SIZE_N"] == 256 and params["REDUCE"] == "atomic"
    assert params["g1_num_stages"] < 4 and kernel.check_params(ungated, params) is None


# --- moetune_grouped_mm: torch's grouped GEMMs with Triton passes between them ------------------
grouped_mm_interpreted = pytest.mark.fresh_process("TRITON_INTERPRET",
                                                   "MOETUNE_GROUPED_MM_CHECKS")
# moetune_grouped_mm's gather, activation and ordered sum around torch's CPU grouped GEMM: top-1,
# top-k with experts no pair routes to (an empty group), the router weight on the input, ungated
# GELU and gated GELU, and H=72, I=40 (multiples of no Triton block).
GROUPED_MM_CASES = [
    MoEProblem(3, 64, 32, 8, 2, dtype="float32"),
    MoEProblem(5, 48, 40, 16, 1, dtype="float16", router_weight_on_input=True),
    MoEProblem(7, 64, 32, 8, 2, dtype="float32", activation="gelu", gated=False),
    MoEProblem(9, 72, 40, 32, 4, dtype="float16", activation="gelu"),
]


@outer_run
def test_grouped_mm_checks_pass_in_a_fresh_process():
    checks_pass_in_a_fresh_process(__file__, "MOETUNE_GROUPED_MM_CHECKS", "grouped_mm",
                                   len(GROUPED_MM_CASES))


@grouped_mm_interpreted
@pytest.mark.parametrize("problem", GROUPED_MM_CASES, ids=case_id)
def test_grouped_mm_kernel_matches_reference_interpreted(problem, cpu_sku):
    fn, batch, ref = prepared("moetune_grouped_mm", {}, problem, cpu_sku)
    out = torch.full_like(batch.x, float("nan"))
    assert fn(*batch.args(), out=out) is out
    assert relative_error(out, ref) <= TOLERANCE[problem.dtype.value]
