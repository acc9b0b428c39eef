"""The typed baselines: which pick of which vLLM a stored variant stands for, and its JSON."""

import dataclasses
import json

import pytest

from moetune.db import BaselineRecord, Candidate, dump_baselines
from moetune.db._rowcheck import parse_baselines


@dataclasses.dataclass(frozen=True)
class Rule:
    kernel: str
    params: dict
    vllm: str | None = None
    configs: str | None = None


TUNED = BaselineRecord(Candidate("vllm_triton", {"BLOCK_SIZE_M": 16, "num_warps": 4}),
                       "0.34.0", "E=8,N=14336,device_name=NVIDIA_H200.json", 12.0, 11.9, 12.2,
                       5, 1.1, 1.2, True, 0)


def test_candidates_compare_by_their_stored_key():
    assert Candidate("k", {"a": 1, "b": 2}) == Candidate("k", {"b": 2, "a": 1})
    assert Candidate("k", {"a": 1}) != Candidate("k", {"a": True})  # as a kernel sees them
    assert len({Candidate("k", {"a": 1}), Candidate("k", {"a": 1})}) == 1


@pytest.mark.parametrize(("rule", "why"), [
    (Rule("vllm_triton", {"num_warps": 4, "BLOCK_SIZE_M": 16}), None),
    (Rule("vllm_triton", {"BLOCK_SIZE_M": 16, "num_warps": 4}, "0.34.2"), None),
    (Rule("vllm_triton", {"BLOCK_SIZE_M": 16, "num_warps": 4}, "0.34.0",
          "E=8,N=14336,device_name=NVIDIA_H200.json"), None),
    (Rule("vllm_triton", {"BLOCK_SIZE_M": 32, "num_warps": 4}), "the rule here is vllm_triton"),
    (Rule("aiter_triton", {"BLOCK_SIZE_M": 16, "num_warps": 4}), "the rule here is aiter"),
    (Rule("vllm_triton", {"BLOCK_SIZE_M": 16, "num_warps": 4}, "0.35.0"),
     "timed against vLLM 0.34's pick, the rule here is vLLM 0.35's"),
    (Rule("vllm_triton", {"BLOCK_SIZE_M": 16, "num_warps": 4}, None, "default"),
     "the rule here takes it from default"),
])
def test_a_baseline_stands_for_a_rule_of_its_kernel_params_vllm_minor_and_configs(rule, why):
    why_not = TUNED.why_not(rule)
    assert why_not is None if why is None else why in why_not
    assert TUNED.stands_for(rule) is (why is None)


def test_a_variant_for_no_vllm_is_not_a_vllm_rule():
    loop = BaselineRecord(Candidate("torch_loop", {}))
    assert loop.stands_for(Rule("torch_loop", {}))
    assert "no vLLM's pick, the rule here is vLLM 0.32's" in loop.why_not(
        Rule("torch_loop", {}, "0.32.0"))


def test_json_round_trips_as_schema_2():
    text = dump_baselines([TUNED, BaselineRecord(Candidate("torch_loop", {}), median_us=40.0)])
    assert json.loads(text)["schema"] == 2
    assert parse_baselines(text) == (TUNED, BaselineRecord(Candidate("torch_loop", {}),
                                                           median_us=40.0))


def test_schema_1_variants_stand_for_vllm_0_32_where_their_kernel_did():
    text = json.dumps({"variants": [{"kernel": k, "params": {}, "median_us": 3.0, "beaten": True,
                                     "vllm": "9.9"} for k in (
        "aiter_triton", "vllm_cpu_experts", "torch_loop")]})
    assert [(b.vllm, b.configs) for b in parse_baselines(text)] == [
        ("0.32.0", None), ("0.32.0", None), (None, None)]


@pytest.mark.parametrize(("variant", "why"), [
    ([], "variant 0: not an object"),
    ({"params": {}}, "variant 0: no kernel name"),
    ({"kernel": "k", "params": {}, "median_us": -1}, "median_us is -1"),
    ({"kernel": "k", "params": {}, "rounds": 2.5}, "rounds is 2.5, not a count"),
    ({"kernel": "k", "params": {}, "ratio_lo": "1"}, "ratio_lo is '1', not a number"),
    ({"kernel": "k", "params": {}, "beaten": 1}, "beaten is 1, not true or false"),
    ({"kernel": "k", "params": {}, "vllm": "latest"}, "vllm is 'latest', not a version"),
    ({"kernel": "k", "params": {}, "configs": 3}, "configs is 3, not text"),
])
def test_a_bad_variant_is_one_clear_error(variant, why):
    with pytest.raises(ValueError, match=why):
        parse_baselines(json.dumps({"schema": 2, "variants": [variant]}))


@pytest.mark.parametrize("schema", [3, "2", True, None])
def test_an_unknown_schema_is_refused(schema):
    with pytest.raises(ValueError, match="not one this moetune reads"):
        parse_baselines(json.dumps({"schema": schema, "variants": []}))
