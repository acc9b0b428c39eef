"""What a Hugging Face config.json declares about its MoE layers beyond their sizes: the weight
quantization, the activation, and features moetune does not tune.

A config with something moetune does not tune is refused with everything it found, never tuned
as a plain shape: a table for the wrong scheme would be served to layers it does not describe
(and vLLM leaves such layers to its own kernels anyway).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moetune.errors import UnsupportedModelError
from moetune.runtime.problem import Activation, QuantScheme

#: What ``--config`` can tune, for the error message.
SUPPORTED = ("unquantized", "fp8 per-tensor (quant_method fp8)",
             "fp8 block 128x128 (quant_method fp8, weight_block_size [128, 128])",
             "compressed-tensors fp8 with tensor, channel (per-token activations) or 128x128 "
             "block weights", "dynamic activation scales", "silu or gelu experts without "
             "biases or a clamped swiglu")
_ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu": Activation.GELU}
#: Architectures whose experts carry biases (the config does not say so itself).
_BIASED_EXPERTS = {"gpt_oss": "GPT-OSS"}


def moe_features(cfg: dict[str, Any], path: Path) -> tuple[QuantScheme, Activation]:
    """The quant scheme and activation of the config's MoE layers.

    Raises:
        UnsupportedModelError: naming everything in the config that moetune does not tune, and
            listing what it does.
    """
    problems: list[str] = []
    model_type = str(cfg.get("model_type", ""))
    if model_type in _BIASED_EXPERTS:
        problems.append(f"expert biases ({_BIASED_EXPERTS[model_type]})")
    if cfg.get("swiglu_limit") is not None:
        problems.append(f"clamped swiglu (swiglu_limit {cfg['swiglu_limit']})")
    hidden_act = str(cfg.get("hidden_act", "silu"))
    activation = _ACTIVATIONS.get(hidden_act)
    if activation is None:
        problems.append(f"activation {hidden_act}")
    quant, why = declared_quant(cfg.get("quantization_config") or {})
    problems += [why] if why else []
    if problems:
        raise UnsupportedModelError(
            f"{path}: moetune does not tune this model's MoE layers: {'; '.join(problems)}. "
            f"Supported: {'; '.join(SUPPORTED)}.")
    assert quant is not None and activation is not None
    return quant, activation


def declared_quant(qcfg: dict[str, Any]) -> tuple[QuantScheme | None, str | None]:
    """The scheme a ``quantization_config`` declares, or None and what is not supported."""
    method = qcfg.get("quant_method")
    if method is None:
        return QuantScheme.NONE, None
    if method == "fp8":
        return _fp8(qcfg)
    if method == "compressed-tensors":
        return _compressed_tensors(qcfg)
    return None, f"quant_method {method}"


def _fp8(qcfg: dict[str, Any]) -> tuple[QuantScheme | None, str | None]:
    """vLLM's ``Fp8Config``: per-tensor weight scales, or one per ``weight_block_size`` block."""
    if qcfg.get("store_dtype") == "mxfp4":
        return None, "fp8 stored as mxfp4 (store_dtype mxfp4)"
    if qcfg.get("activation_scheme", "dynamic") != "dynamic":
        return None, (f"static activation scales (activation_scheme "
                      f"{qcfg['activation_scheme']}); moetune's kernels quantize dynamically")
    block = qcfg.get("weight_block_size")
    if block is None:
        return QuantScheme.FP8_PER_TENSOR, None
    if list(block) == [128, 128]:
        return QuantScheme.FP8_BLOCK_128X128, None
    return None, f"fp8 block {'x'.join(map(str, block))} (weight_block_size {list(block)})"


def _compressed_tensors(qcfg: dict[str, Any]) -> tuple[QuantScheme | None, str | None]:
    """compressed-tensors fp8 as vLLM's MoE method reads it: weights per tensor (with per-tensor
    activations), per channel (with per-token activations) or per 128x128 block."""
    groups = list((qcfg.get("config_groups") or {}).values())
    if len(groups) != 1:
        return None, f"compressed-tensors with {len(groups)} quantization groups"
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
        return None, (f"compressed-tensors {weights.get('type')} {weights.get('num_bits')}-bit "
                      "weights")
    if acts is None:
        return None, "compressed-tensors fp8 weight-only (no input_activations)"
    if not acts.get("dynamic"):
        return None, "static activation scales; moetune's kernels quantize dynamically"
    strategy, act_strategy = weights.get("strategy"), acts.get("strategy")
    if strategy == "tensor" and act_strategy == "tensor":
        return QuantScheme.FP8_PER_TENSOR, None
    if strategy == "channel" and act_strategy == "token":
        return QuantScheme.FP8_PER_CHANNEL, None
    if strategy == "block" and list(weights.get("block_structure") or []) == [128, 128]:
        return QuantScheme.FP8_BLOCK_128X128, None
    return None, (f"compressed-tensors fp8 {strategy} weights "
                  f"{weights.get('block_structure') or ''} with {act_strategy} activations")
