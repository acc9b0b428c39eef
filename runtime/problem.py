"""What a MoE call is, as far as kernel choice goes: ``MoEProblem`` and its num_tokens buckets."""

from __future__ import annotations

import bisect
import dataclasses
import enum
from typing import Any

from moetune.errors import InvalidProblemError

#: The num_tokens grid that vLLM's and SGLang's tuners use; buckets are these points.
DEFAULT_BUCKETS: tuple[int, ...] = (
    1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096,
)


class QuantScheme(str, enum.Enum):
    """How weights (and activations) are quantized. Values are stable ids stored in tables."""

    NONE = "none"
    FP8_PER_TENSOR = "fp8_per_tensor"
    FP8_PER_CHANNEL = "fp8_per_channel"  # per-output-channel weights, per-token activations
    FP8_BLOCK_128X128 = "fp8_block_128x128"

    @property
    def is_fp8(self) -> bool:
        return self is not QuantScheme.NONE


class Activation(str, enum.Enum):
    SILU = "silu"
    GELU = "gelu"


class DType(str, enum.Enum):
    """Activation (input/output) dtype of the layer."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


def parse_enum(kind: type[enum.Enum], value: str) -> Any:
    """Normalise a user string (``"FP8-Block-128x128"``) to an enum member, once, at the boundary."""
    if isinstance(value, kind):
        return value
    key = str(value).strip().lower().replace("-", "_")
    for member in kind:
        if member.value == key:
            return member
    valid = ", ".join(m.value for m in kind)
    raise InvalidProblemError(f"unknown {kind.__name__} {value!r}; expected one of: {valid}")


#: The largest size of any dimension: sizes are stored as 64-bit integers and multiplied into
#: element counts, and no MoE layer comes near 2^31 along one dimension.
MAX_SIZE = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class MoEProblem:
    """Everything about one MoE call that changes which kernel is valid or fastest.

    ``intermediate_size`` is per partition (after TP/EP sharding), ``num_experts`` the local
    experts. ``router_weight_on_input`` scales each token's input by its router weight before the
    first GEMM (Llama-4's top-1 routing) instead of scaling the output.
    """

    num_tokens: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    topk: int
    dtype: DType = DType.BFLOAT16
    quant: QuantScheme = QuantScheme.NONE
    activation: Activation = Activation.SILU
    gated: bool = True
    router_weight_on_input: bool = False

    def __post_init__(self) -> None:
        for name in ("num_tokens", "hidden_size", "intermediate_size", "num_experts", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIZE:
                raise InvalidProblemError(f"{name} must be an integer from 1 to {MAX_SIZE}, "
                                          f"got {value!r}")
        if self.topk > self.num_experts:
            raise InvalidProblemError(
                f"topk ({self.topk}) cannot exceed num_experts ({self.num_experts})"
            )
        for name, kind in (("dtype", DType), ("quant", QuantScheme), ("activation", Activation)):
            if not isinstance(getattr(self, name), kind):
                object.__setattr__(self, name, parse_enum(kind, getattr(self, name)))
        if self.quant is QuantScheme.FP8_BLOCK_128X128 and (
            self.hidden_size % 128 or self.intermediate_size % 128
        ):
            raise InvalidProblemError(
                "fp8_block_128x128 needs hidden_size and intermediate_size divisible by 128, "
                f"got {self.hidden_size} and {self.intermediate_size}"
            )

    @property
    def shape(self) -> Shape:
        """The problem without num_tokens: what a layer fixes at load."""
        return Shape(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Shape)})

    def bucket(self, grid: tuple[int, ...] = DEFAULT_BUCKETS) -> MoEProblem:
        """The problem with num_tokens replaced by its bucket (see ``bucket_of``)."""
        return dataclasses.replace(self, num_tokens=bucket_of(self.num_tokens, grid))

    def with_tokens(self, num_tokens: int) -> MoEProblem:
        return dataclasses.replace(self, num_tokens=num_tokens)

    def to_row(self) -> dict[str, Any]:
        """Plain values for storage and JSON (enums by value)."""
        row = dataclasses.asdict(self)
        for name in ("dtype", "quant", "activation"):
            row[name] = row[name].value
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> MoEProblem:
        return cls(**{f.name: row[f.name] for f in dataclasses.fields(cls)})

    def describe(self) -> str:
        return (
            f"M={self.num_tokens} H={self.hidden_size} I={self.intermediate_size} "
            f"E={self.num_experts} topk={self.topk} {self.dtype.value} {self.quant.value} "
            f"{self.activation.value}{'' if self.gated else ' ungated'}"
            f"{' tkw-in' if self.router_weight_on_input else ''}"
        )


@dataclasses.dataclass(frozen=True)
class Shape:
    """A ``MoEProblem`` minus num_tokens. Buckets are never borrowed across shapes."""

    hidden_size: int
    intermediate_size: int
    num_experts: int
    topk: int
    dtype: DType
    quant: QuantScheme
    activation: Activation
    gated: bool
    router_weight_on_input: bool

    def problem(self, num_tokens: int) -> MoEProblem:
        return MoEProblem(num_tokens=num_tokens, **dataclasses.asdict(self))


def bucket_of(num_tokens: int, grid: tuple[int, ...] = DEFAULT_BUCKETS) -> int:
    """Map num_tokens to a grid point: the nearest one, ties to the smaller, beyond the grid its end.

    This is vLLM's rule for its tuned-config files (12 -> 8, 20 -> 16, 5000 -> 4096), so a
    table exported to vLLM behaves the same as inside moetune.
    """
    return nearest(num_tokens, grid)


def nearest(value: int, sorted_points: tuple[int, ...] | list[int]) -> int:
    """The point of ``sorted_points`` nearest to ``value``; ties go to the smaller point."""
    if not sorted_points:
        raise ValueError("no points to choose from")
    i = bisect.bisect_left(sorted_points, value)
    if i == 0:
        return sorted_points[0]
    if i == len(sorted_points):
        return sorted_points[-1]
    below, above = sorted_points[i - 1], sorted_points[i]
    return above if above - value < value - below else below


def bucket_text(row: dict[str, Any]) -> str:
    """A stored bucket as a person reads it, ``M=4 H=64 I=32 E=4 topk=2 ...``
    (``MoEProblem.describe``); where its columns make no valid problem, ``name=value`` pairs."""
    try:
        return MoEProblem.from_row(row).describe()
    except (InvalidProblemError, ValueError, TypeError, KeyError):
        return " ".join(f"{k}={v}" for k, v in row.items())
