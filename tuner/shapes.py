"""Turning command-line shape options into problems: a preset, a config.json, or explicit sizes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterable

from moetune import db
from moetune.errors import FormatError, ShapeError
from moetune.runtime.dispatcher import row_verdict
from moetune.runtime.platform import SKU
from moetune.runtime.problem import (DEFAULT_BUCKETS, MAX_SIZE, Activation, DType, MoEProblem,
                                     QuantScheme, Shape, parse_enum)
from moetune.tuner.presets import preset, shape_from_config


@dataclasses.dataclass(frozen=True)
class ShapeOptions:
    """What a user may say about a shape; explicit sizes override the preset's or config's."""

    preset: str | None = None
    config: Path | None = None
    tp: int = 1
    ep: int = 1
    hidden: int | None = None
    intermediate: int | None = None
    experts: int | None = None
    topk: int | None = None
    dtype: DType | str | None = None
    quant: QuantScheme | str | None = None
    activation: Activation | str | None = None
    router_weight_on_input: bool | None = None


def resolve(opts: ShapeOptions) -> tuple[Shape, tuple[int, ...]]:
    """The shape described by ``opts`` and its default buckets.

    Raises:
        ShapeError: no shape given, both a preset and a config, or an invalid shape.
    """
    if opts.preset and opts.config:
        raise ShapeError("give either --preset or --config, not both")
    if opts.tp < 1 or opts.ep < 1:
        raise ShapeError(f"--tp and --ep must be positive, got --tp {opts.tp} --ep {opts.ep}")
    if (opts.tp, opts.ep) != (1, 1) and not opts.config:
        raise ShapeError("--tp and --ep shard a --config model; a preset's and explicit sizes "
                         "are per partition already: drop --tp/--ep, or give --intermediate "
                         "and --experts for one partition")
    buckets = DEFAULT_BUCKETS
    if opts.preset:
        p = preset(opts.preset)
        base, buckets = dataclasses.asdict(p.shape), p.buckets
    elif opts.config:
        base = dataclasses.asdict(shape_from_config(opts.config, tp=opts.tp, ep=opts.ep,
                                                    dtype=opts.dtype))
    else:
        base = {"dtype": DType.BFLOAT16, "quant": QuantScheme.NONE,
                "activation": Activation.SILU, "gated": True, "router_weight_on_input": False}
    overrides = {
        "hidden_size": opts.hidden, "intermediate_size": opts.intermediate,
        "num_experts": opts.experts, "topk": opts.topk,
        "dtype": opts.dtype and parse_enum(DType, opts.dtype),
        "quant": opts.quant and parse_enum(QuantScheme, opts.quant),
        "activation": opts.activation and parse_enum(Activation, opts.activation),
        "router_weight_on_input": opts.router_weight_on_input,
    }
    base.update({k: v for k, v in overrides.items() if v is not None})
    missing = [f.name for f in dataclasses.fields(Shape) if f.name not in base]
    if missing:
        raise ShapeError("no shape given: use --preset, --config or all of --hidden "
                         "--intermediate --experts --topk")
    shape = Shape(**base)
    shape.problem(1)  # validates sizes, topk <= experts, quant constraints
    return shape, buckets


def parse_buckets(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    """``"1,8,64"`` -> (1, 8, 64); None -> ``default``."""
    if not text:
        return default
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ShapeError(f"--buckets must be comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1 or values[-1] > MAX_SIZE:
        raise ShapeError(f"--buckets must be integers from 1 to {MAX_SIZE}, got {text!r}")
    return tuple(values)


def problems_from_misses(path: Path) -> list[MoEProblem]:
    """Problems a serving process recorded as table misses (JSON lines), de-duplicated.

    Raises:
        FormatError: unreadable file or a line that is not a problem.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: cannot read misses file ({e})") from None
    problems: dict[MoEProblem, None] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            problems[MoEProblem.from_row(json.loads(line))] = None
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(f"{path}:{n}: not a recorded problem ({e})") from None
    return list(problems)


def problems_in_table(rows: Iterable[db.WinnerRecord], sku: SKU) -> list[MoEProblem]:
    """The buckets a table has winners for on ``sku`` (rows whose bucket is not a problem are
    left out), in a stable order: shape, then num_tokens.

    Raises:
        ShapeError: the table has none for ``sku``.
    """
    problems = {v.problem for v in (row_verdict(r, sku) for r in rows)
                if not v.other_sku and v.problem is not None}
    if not problems:
        raise ShapeError(f"the table has no buckets for {sku.label()}: give a shape "
                         "(--preset, --config or the sizes)")
    return sorted(problems, key=lambda p: (dataclasses.replace(p, num_tokens=1).describe(),
                                           p.num_tokens))
