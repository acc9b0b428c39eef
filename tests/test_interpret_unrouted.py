"""Slots routed nowhere (``topk_ids`` -1) in the kernels that skip them, through Triton's
interpreter on this CPU (``tests/interpreted.py``)."""

from __future__ import annotations

import pytest
import torch

from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import default_registry
from moetune.tuner.gate import relative_error
from moetune.tuner.inputs import make_weights
from tests.interpreted import (DECODE, GROUPED, ONE, TOLERANCE, case_id,
                               checks_pass_in_a_fresh_process, needs_triton, outer_run, prepared)
from tests.routing_checks import check_routing, random_ids, with_unrouted

pytestmark = needs_triton

unrouted_interpreted = pytest.mark.fresh_process("TRITON_INTERPRET", "MOETUNE_UNROUTED_CHECKS")
# Each way a kernel's rows meet: moetune_grouped's three reduces, top-1's direct store, two
# block heights (two aligns), the sorted intermediate and the persistent GEMM2; moetune_decode's
# atomics, ordered split-K partials and top-1 store; moetune_decode_one's ordered reduce and
# top-1 store over several programs. The router weight on the input, gated or not.
UNROUTED_CASES = [
    ("moetune_grouped", MoEProblem(5, 64, 32, 8, 2, dtype="float32"), GROUPED),
    ("moetune_grouped", MoEProblem(7, 72, 40, 4, 3, dtype="float16"),
     {**GROUPED, "REDUCE": "atomic_out"}),
    ("moetune_grouped", MoEProblem(6, 64, 48, 8, 2, dtype="float32", activation="gelu",
                                   gated=False), {**GROUPED, "REDUCE": "sum"}),
    ("moetune_grouped", MoEProblem(4, 48, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     GROUPED),
    ("moetune_grouped", MoEProblem(7, 72, 40, 4, 3, dtype="float16"),
     {**GROUPED, "g2_BLOCK_SIZE_M": 32, "REDUCE": "sum"}),
    ("moetune_grouped", MoEProblem(5, 64, 32, 8, 2, dtype="float32"),
     {**GROUPED, "g2_A_TMA": 1, "g2_PERSISTENT": 2, "REDUCE": "sum"}),
    ("moetune_decode", MoEProblem(3, 64, 32, 8, 2, dtype="float32"), DECODE),
    ("moetune_decode", MoEProblem(4, 64, 64, 8, 2, dtype="float32"),
     {**DECODE, "SPLIT_K": 2, "REDUCE": "ordered"}),
    ("moetune_decode", MoEProblem(3, 72, 40, 8, 1, dtype="float16", router_weight_on_input=True),
     DECODE),
    ("moetune_decode", MoEProblem(3, 48, 40, 8, 3, dtype="float16", activation="gelu",
                                  gated=False), {**DECODE, "REDUCE": "atomic_out"}),
    ("moetune_decode_one", MoEProblem(4, 64, 32, 8, 2, dtype="float32"),
     {**ONE, "PROGRAMS_PER_SM": 4}),
    ("moetune_decode_one", MoEProblem(3, 72, 40, 8, 1, dtype="float16",
                                      router_weight_on_input=True), {**ONE, "PROGRAMS_PER_SM": 3}),
    ("moetune_decode_one", MoEProblem(3, 48, 40, 8, 3, dtype="float16", activation="gelu",
                                      gated=False), {**ONE, "PROGRAMS_PER_SM": 3}),
]


@outer_run
def test_unrouted_checks_pass_in_a_fresh_process():
    checks_pass_in_a_fresh_process(__file__, "MOETUNE_UNROUTED_CHECKS", "unrouted",
                                   len(UNROUTED_CASES) + 2)


@unrouted_interpreted
@pytest.mark.parametrize("one_program", [True, False], ids=["one-launch", "three-launches"])
def test_align_leaves_unrouted_pairs_out_of_every_block(one_program):
    from moetune.runtime.kernels._align import ONE_PROGRAM_MAX, align

    gen = torch.Generator().manual_seed(0)
    for m, topk, e, block in ((3, 2, 8, 16), (37, 8, 256, 64), (300, 8, 128, 16)):
        ids = random_ids(m, topk, e, gen)
        ids[torch.rand(ids.shape, generator=gen) < 0.3] = -1
        ids[0] = -1
        for routing_ids in (ids, torch.full_like(ids, -1)):
            r = align(routing_ids, block, e,
                      one_program_max=ONE_PROGRAM_MAX if one_program else 0)
            check_routing(routing_ids, block, e, r)


@unrouted_interpreted
@pytest.mark.parametrize("name,problem,params", UNROUTED_CASES,
                         ids=lambda c: case_id(c) if not isinstance(c, str) else c)
def test_unrouted_slots_contribute_nothing_interpreted(name, problem, params, cpu_sku):
    """Rows routed nowhere come out zero (their NaN activations unread), a row with one slot
    routed nowhere is the reference's without it, and a call routed nowhere at all (a CUDA
    graph's capture) gives zeros and leaves the next call right (counters, buffers)."""
    fn, batch, _ = prepared(name, params, problem, cpu_sku)
    weights = make_weights(problem, "cpu", seed=1)
    reference = default_registry.get("reference").prepare(problem, {}, weights)
    for rows in ((), None):
        call, ref_call, empty = with_unrouted(*batch.args(), rows=rows)
        out = torch.full_like(batch.x, float("nan"))
        assert fn(*call, out=out) is out
        assert (out[empty] == 0).all() and empty.any()
        if not empty.all():
            assert relative_error(out, reference(*ref_call)) <= TOLERANCE[problem.dtype.value]
    out = fn(*batch.args())
    assert relative_error(out, reference(*batch.args())) <= TOLERANCE[problem.dtype.value]
