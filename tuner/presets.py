"""Problem shapes to tune: named presets of real models, and shapes read from a local config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from moetune.errors import FormatError, InvalidProblemError, ShapeError
from moetune.runtime.problem import (DEFAULT_BUCKETS, Activation, DType, QuantScheme, Shape,
                                     parse_enum)
from moetune.tuner.hf_config import moe_features


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    shape: Shape
    buckets: tuple[int, ...]
    about: str


def _shape(h: int, i: int, e: int, k: int, dtype: DType = DType.BFLOAT16,
           quant: QuantScheme = QuantScheme.NONE, on_input: bool = False) -> Shape:
    shape = Shape(h, i, e, k, dtype, quant, Activation.SILU, True, on_input)
    shape.problem(1)  # validate once, here
    return shape


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("tiny", _shape(128, 256, 8, 2), (1, 4, 16, 64, 256),
           "toy shape for tests and demos; a CPU tune takes seconds"),
    Preset("mixtral-8x7b", _shape(4096, 14336, 8, 2), DEFAULT_BUCKETS,
           "Mixtral-8x7B, bf16, unsharded"),
    Preset("qwen3-30b-a3b", _shape(2048, 768, 128, 8), DEFAULT_BUCKETS,
           "Qwen3-30B-A3B, bf16, unsharded"),
    Preset("qwen3-235b-a22b", _shape(4096, 192, 128, 8), DEFAULT_BUCKETS,
           "Qwen3-235B-A22B, bf16, TP8 shard (I=1536/8)"),
    Preset("deepseek-v3", _shape(7168, 256, 256, 8, quant=QuantScheme.FP8_BLOCK_128X128),
           DEFAULT_BUCKETS, "DeepSeek-V3, TP8 shard (I=2048/8), fp8 block 128x128"),
    Preset("llama-4-maverick",
           _shape(5120, 1024, 128, 1, quant=QuantScheme.FP8_PER_CHANNEL, on_input=True),
           DEFAULT_BUCKETS, "Llama-4-Maverick, TP8 shard (I=8192/8), top-1, router weight on "
           "input, fp8 per-channel"),
)}


def preset(name: str) -> Preset:
    """Raises: ShapeError naming the valid presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ShapeError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_INTER_KEYS = ("moe_intermediate_size", "intermediate_size_moe", "intermediate_size")


def shape_from_config(path: Path, *, tp: int = 1, ep: int = 1,
                      dtype: str | None = None) -> Shape:
    """The MoE shape of a Hugging Face ``config.json`` sharded by tensor/expert parallelism.

    With EP the experts are split across ``ep`` ranks and each keeps whole experts; with TP the
    intermediate size is split across ``tp`` ranks (vLLM's sharding).

    Raises:
        FormatError: unreadable file, or no MoE fields in it.
        UnsupportedModelError: MoE layers moetune does not tune (``hf_config.moe_features``).
    """
    try:
        cfg: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: cannot read config.json ({e})") from None
    cfg = {**cfg, **cfg.get("text_config", {})}  # Llama-4 and other multimodal nesting
    experts = next((cfg[k] for k in _EXPERTS_KEYS if cfg.get(k)), None)
    inter = next((cfg[k] for k in _INTER_KEYS if cfg.get(k)), None)
    if not experts or not inter or "hidden_size" not in cfg:
        raise FormatError(f"{path}: not a MoE config (need hidden_size, an expert count and an "
                          f"intermediate size; experts={experts}, intermediate={inter})")
    if tp < 1 or ep < 1 or experts % ep or inter % tp:
        raise InvalidProblemError(
            f"cannot shard {experts} experts over ep={ep} and intermediate {inter} over tp={tp}")
    quant, act = moe_features(cfg, path)
    # transformers 5 writes "dtype"; older versions "torch_dtype".
    torch_dtype = dtype or str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    on_input = cfg.get("model_type") in ("llama4", "llama4_text")
    shape = Shape(cfg["hidden_size"], inter // tp, experts // ep,
                  cfg.get("num_experts_per_tok", 2), parse_enum(DType, torch_dtype), quant,
                  act, True, on_input)
    shape.problem(1)
    return shape
