import pytest

from moetune.errors import InvalidProblemError
from moetune.runtime.problem import (DEFAULT_BUCKETS, MoEProblem, QuantScheme, bucket_of,
                                     parse_enum)


def test_default_grid_is_the_18_point_serving_grid():
    assert len(DEFAULT_BUCKETS) == 18 and DEFAULT_BUCKETS[0] == 1 and DEFAULT_BUCKETS[-1] == 4096


@pytest.mark.parametrize("m,bucket", [(1, 1), (3, 2), (12, 8), (20, 16), (7, 8), (40, 32),
                                      (192, 128), (768, 512), (2560, 2048), (5000, 4096)])
def test_bucket_rule_matches_vllm_nearest_key(m, bucket):
    assert bucket_of(m) == bucket


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(topk=9), "topk"),
    (dict(quant="int3"), "unknown QuantScheme"),
    (dict(quant="fp8_block_128x128", hidden_size=100), "divisible by 128"),
])
def test_invalid_problems_are_refused(kwargs, match):
    base = dict(num_tokens=4, hidden_size=128, intermediate_size=256, num_experts=8, topk=2)
    with pytest.raises(InvalidProblemError, match=match):
        MoEProblem(**{**base, **kwargs})


def test_strings_are_normalised_once_and_rows_round_trip():
    p = MoEProblem(4, 128, 256, 8, 2, dtype="BFloat16", quant="FP8-Block-128x128")
    assert p.quant is QuantScheme.FP8_BLOCK_128X128
    assert MoEProblem.from_row(p.to_row()) == p
    assert p.bucket().num_tokens == 4 and p.with_tokens(5).bucket().num_tokens == 4
    assert p.shape.problem(4) == p


def test_parse_enum_lists_choices():
    with pytest.raises(InvalidProblemError, match="fp8_per_tensor"):
        parse_enum(QuantScheme, "fp4")
