"""Presets and shapes read from local Hugging Face config.json files."""

import json

import pytest

from moetune.errors import MoetuneError, UnsupportedModelError
from moetune.runtime.problem import QuantScheme
from moetune.tuner.presets import PRESETS, shape_from_config
from moetune.tuner.shapes import ShapeOptions, parse_buckets, problems_from_misses, resolve


def write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_presets_cover_the_named_models():
    assert {"tiny", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "llama-4-maverick"} <= set(
        PRESETS)
    ds = PRESETS["deepseek-v3"].shape
    assert (ds.hidden_size, ds.intermediate_size, ds.num_experts, ds.topk) == (7168, 256, 256, 8)
    assert ds.quant is QuantScheme.FP8_BLOCK_128X128
    llama = PRESETS["llama-4-maverick"].shape
    assert llama.topk == 1 and llama.router_weight_on_input
    assert llama.quant is QuantScheme.FP8_PER_CHANNEL


def test_mixtral_config_with_tp(tmp_path):
    path = write(tmp_path, {"model_type": "mixtral", "hidden_size": 4096,
                            "intermediate_size": 14336, "num_local_experts": 8,
                            "num_experts_per_tok": 2, "torch_dtype": "bfloat16",
                            "hidden_act": "silu"})
    shape = shape_from_config(path, tp=2)
    assert (shape.hidden_size, shape.intermediate_size, shape.num_experts) == (4096, 7168, 8)
    new_style = write(tmp_path, {"hidden_size": 64, "intermediate_size": 128,
                                 "num_local_experts": 4, "dtype": "float32"})
    assert shape_from_config(new_style).dtype.value == "float32"  # transformers 5 key


def test_deepseek_config_with_block_fp8_and_ep(tmp_path):
    path = write(tmp_path, {"model_type": "deepseek_v3", "hidden_size": 7168,
                            "intermediate_size": 18432, "moe_intermediate_size": 2048,
                            "n_routed_experts": 256, "num_experts_per_tok": 8,
                            "quantization_config": {"quant_method": "fp8",
                                                    "weight_block_size": [128, 128]}})
    shape = shape_from_config(path, ep=8)
    assert (shape.intermediate_size, shape.num_experts) == (2048, 32)
    assert shape.quant is QuantScheme.FP8_BLOCK_128X128


def test_llama4_nested_text_config(tmp_path):
    path = write(tmp_path, {"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
        "num_local_experts": 128, "num_experts_per_tok": 1}})
    shape = shape_from_config(path, tp=8)
    assert shape.router_weight_on_input and shape.intermediate_size == 1024


@pytest.mark.parametrize("cfg,message", [
    ({"hidden_size": 4096, "intermediate_size": 11008}, "not a MoE config"),
    ({"hidden_size": 64, "intermediate_size": 100, "num_local_experts": 8}, "cannot shard"),
])
def test_bad_configs_are_refused(tmp_path, cfg, message):
    with pytest.raises(MoetuneError, match=message):
        shape_from_config(write(tmp_path, cfg), tp=3)


def test_explicit_sizes_override_and_buckets_parse():
    shape, buckets = resolve(ShapeOptions(preset="tiny", hidden=256))
    assert shape.hidden_size == 256 and buckets == PRESETS["tiny"].buckets
    assert parse_buckets("64, 1,8", ()) == (1, 8, 64)
    with pytest.raises(MoetuneError):
        parse_buckets("1,x", ())
    with pytest.raises(MoetuneError, match="no shape given"):
        resolve(ShapeOptions(hidden=64))


def test_misses_file_is_deduplicated_and_validated(tmp_path):
    row = PRESETS["tiny"].shape.problem(16).to_row()
    path = tmp_path / "misses.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (row, row, {**row, "num_tokens": 1})) + "\n")
    assert [p.num_tokens for p in problems_from_misses(path)] == [16, 1]
    path.write_text('{"num_tokens": 1}\n')
    with pytest.raises(MoetuneError, match="misses.jsonl:1"):
        problems_from_misses(path)


MIXTRAL = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512,
           "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu"}
GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
           "num_local_experts": 32, "num_experts_per_tok": 4, "hidden_act": "silu",
           "swiglu_limit": 7.0, "quantization_config": {"quant_method": "mxfp4"}}


def fp8(**qcfg):
    return {**MIXTRAL, "quantization_config": {"quant_method": "fp8", **qcfg}}


def compressed(weights, acts):
    return {**MIXTRAL, "quantization_config": {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": acts}}}}


FP8_W = {"type": "float", "num_bits": 8, "dynamic": False}


@pytest.mark.parametrize("cfg,quant", [
    (fp8(weight_block_size=[128, 128], activation_scheme="dynamic"), "fp8_block_128x128"),
    (fp8(activation_scheme="dynamic"), "fp8_per_tensor"),
    (compressed({**FP8_W, "strategy": "channel"}, {**FP8_W, "strategy": "token", "dynamic": True}),
     "fp8_per_channel"),
    (compressed({**FP8_W, "strategy": "tensor"}, {**FP8_W, "strategy": "tensor", "dynamic": True}),
     "fp8_per_tensor"),
    (compressed({**FP8_W, "strategy": "block", "block_structure": [128, 128]},
                {**FP8_W, "strategy": "group", "group_size": 128, "dynamic": True}),
     "fp8_block_128x128"),
], ids=["fp8-block", "fp8-tensor", "ct-channel", "ct-tensor", "ct-block"])
def test_fp8_configs_are_read_as_the_checkpoint_declares(tmp_path, cfg, quant):
    assert shape_from_config(write(tmp_path, cfg)).quant.value == quant


@pytest.mark.parametrize("cfg,named", [
    (GPT_OSS, ["expert biases (GPT-OSS)", "clamped swiglu (swiglu_limit 7.0)",
               "quant_method mxfp4"]),
    (fp8(weight_block_size=[64, 64]), ["fp8 block 64x64 (weight_block_size [64, 64])"]),
    (fp8(activation_scheme="static"), ["static activation scales (activation_scheme static)"]),
    ({**MIXTRAL, "quantization_config": {"quant_method": "awq", "bits": 4}},
     ["quant_method awq"]),
    (compressed({**FP8_W, "strategy": "channel"}, None), ["fp8 weight-only"]),
    ({**MIXTRAL, "hidden_act": "relu2"}, ["activation relu2"]),
], ids=["gpt-oss", "fp8-64x64", "fp8-static", "awq", "ct-weight-only", "relu2"])
def test_unsupported_models_are_refused_naming_why_and_what_is_supported(tmp_path, cfg, named):
    with pytest.raises(UnsupportedModelError) as e:
        shape_from_config(write(tmp_path, cfg))
    message = str(e.value)
    assert all(n in message for n in named), message
    assert "Supported: unquantized; fp8 per-tensor" in message and "128x128" in message


def test_tune_on_an_unsupported_config_is_one_error_line_and_exit_1(tmp_path):
    from typer.testing import CliRunner

    from moetune.cli import app

    output = tmp_path / "t.db"
    result = CliRunner().invoke(app, ["tune", "--config", str(write(tmp_path, GPT_OSS)),
                                      "--output", str(output)])
    assert result.exit_code == 1
    (line,) = [ln for ln in result.output.splitlines() if ln.strip()]
    assert line.startswith("error:") and "expert biases" in line and "mxfp4" in line
    assert not output.exists()
