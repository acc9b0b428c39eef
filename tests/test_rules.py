"""One test per platform rule: what serving runs when the table has nothing."""

import dataclasses

import pytest

from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem
from moetune.runtime.rules import rule_choice

ROCM = SKU(Vendor.AMD, "MI300X", "gfx942", 304, 192 << 30)
BASE = MoEProblem(16, 7168, 256, 256, 8)


def test_cpu_rule_is_the_plain_torch_loop(cpu_sku):
    assert rule_choice(BASE, cpu_sku).kernel == "torch_loop"


@pytest.mark.parametrize("changes,kernel", [
    (dict(quant="fp8_block_128x128"), "aiter_asm_blockscale"),
    (dict(quant="fp8_per_channel", router_weight_on_input=True, topk=1), "aiter_asm_tkw1"),
    (dict(quant="fp8_per_channel", router_weight_on_input=True, topk=2), "aiter_fused_moe"),
    (dict(quant="fp8_per_channel", topk=1), "aiter_fused_moe"),
    (dict(), "aiter_fused_moe"),
])
def test_rocm_rule_is_the_seed_rule(changes, kernel):
    assert rule_choice(dataclasses.replace(BASE, **changes), ROCM).kernel == kernel
