"""Small tables and models for the vLLM engine tests, written with the db API and transformers.

``write_winners`` stores chosen winners for a shape (what a tuning run would store, without
spending the time); ``tiny_model`` saves a random MoE checkpoint that vLLM loads from disk.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moetune import db
from moetune.runtime.platform import SKU, detect_sku, environment
from moetune.runtime.problem import Shape
from moetune.runtime.rules import rule_choice


def write_winners(path: Path, shape: Shape, buckets: Iterable[int], kernel: str,
                  params: dict[str, Any] | None = None, sku: SKU | None = None) -> Path:
    """A table whose winner for each of ``buckets`` of ``shape`` is ``kernel`` (``params``),
    with the baseline a tuning run here would time: the rule's pick on ``sku``."""
    sku = sku or detect_sku("cpu")
    with db.write_table(path) as table, table.session() as s:
        sku_row = db.get_or_create_sku(s, vendor=sku.vendor.value, name=sku.name, arch=sku.arch,
                                       compute_units=sku.compute_units,
                                       memory_bytes=sku.memory_bytes)
        run = db.start_run(s, sku_row, environment=environment(), command="tests/vllm_tables",
                           commit=None, driver=None)
        for m in buckets:
            problem = shape.problem(m)
            rule = rule_choice(problem, sku)  # the baseline a tuning run on this CPU times
            bucket = db.get_or_create_bucket(s, **problem.to_row())
            us = 20.0 if (kernel, params or {}) == (rule.kernel, rule.params) else 10.0
            db.set_winner(s, sku_row, bucket, run, kernel, params or {}, median_us=us,
                          p20_us=us * 0.9, p80_us=us * 1.1, error=0.0,
                          baseline_kernel=rule.kernel, baseline_params=rule.params,
                          baseline_us=20.0)
        db.finish_run(s, run, "finished")
    return path


# (architecture, config) of the tiny models: hidden 128, fp32, 2 layers, 512-token vocabulary.
MODELS: dict[str, dict[str, Any]] = {
    "mixtral": {"cls": "Mixtral", "hidden_size": 128, "intermediate_size": 64,
                "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"cls": "Qwen3Moe", "hidden_size": 128, "intermediate_size": 256,
                  "moe_intermediate_size": 64, "num_experts": 16, "num_experts_per_tok": 4,
                  "head_dim": 32, "norm_topk_prob": True},
}


def tiny_model(name: str, directory: Path) -> Path:
    """Save a randomly initialised float32 MoE model ``name`` (a key of ``MODELS``)."""
    import torch

    spec = dict(MODELS[name])
    return tiny_model_from(spec.pop("cls"), spec, directory, torch.float32)


def tiny_model_from(cls: str, spec: dict[str, Any], directory: Path, dtype: Any) -> Path:
    """Save a randomly initialised (seed 0) ``{cls}ForCausalLM`` with ``spec`` in ``dtype``."""
    import torch
    import transformers

    config = getattr(transformers, f"{cls}Config")(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=512, **spec)
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(config).to(dtype)
    model.save_pretrained(directory)
    return directory


#: Block-fp8 Mixtral: hidden and intermediate multiples of 128, so whole 128x128 blocks.
FP8_BLOCK_MODEL: dict[str, Any] = {"cls": "Mixtral", "hidden_size": 128, "intermediate_size": 256,
                                   "num_local_experts": 8, "num_experts_per_tok": 2}


def fp8_block_model(directory: Path, dtype: str = "bfloat16") -> Path:
    """Save a random Mixtral as a block-fp8 checkpoint in DeepSeek-V3's format.

    Each expert's ``w1``/``w2``/``w3`` is stored as fp8 e4m3 with a float32
    ``weight_scale_inv`` per 128x128 block (``weight = q * scale_inv``); config.json says
    ``quant_method: fp8``, ``weight_block_size: [128, 128]``, ``activation_scheme: dynamic``.
    Attention stays unquantized (``modules_to_not_convert``), so only the MoE layers are fp8.
    """
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from moetune.runtime.kernels.quant import quantize_fp8
    from moetune.runtime.problem import QuantScheme

    spec = dict(FP8_BLOCK_MODEL)
    cls = spec.pop("cls")
    tiny_model_from(cls, spec, directory, getattr(torch, dtype))
    path = directory / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if ".experts." in n]:
        q, scale = quantize_fp8(tensors[name][None].float(), QuantScheme.FP8_BLOCK_128X128)
        tensors[name] = q[0].contiguous()
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale[0].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    layers = range(config["num_hidden_layers"])
    config["quantization_config"] = {
        "quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
        "modules_to_not_convert": [f"model.layers.{i}.self_attn.{p}_proj"
                                   for i in layers for p in ("q", "k", "v", "o")]}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def model_shape(directory: Path, dtype: str = "float32") -> Shape:
    """The MoE shape vLLM sees for the saved model in ``dtype``, read as ``--config`` reads it."""
    from moetune.tuner.presets import shape_from_config

    return shape_from_config(directory / "config.json", dtype=dtype)
