"""The device's ceilings (HBM bandwidth, matmul rates) and the floors they put under a MoE call.

A bucket's HBM floor is the time to read the weights of the experts its tokens route to (plus
the activations in and out) at the measured bandwidth; its compute floor the time of its GEMM
FLOPs at the measured matmul rate of the layer's GEMM dtype. The roofline is the larger of the
two: no kernel can be faster, so ``roofline / time`` says how much a better kernel could still
win. ``moetune tune --device cuda`` records the ceilings with its run; ``moetune report`` and
``scripts/bench_roofline.py`` draw the floors from them. Only :func:`measure_ceilings` needs a GPU.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable

from moetune.errors import FormatError
from moetune.runtime.problem import DType, MoEProblem, QuantScheme

#: fp8 block-scaled weights carry one float32 scale per 128x128 block.
_BLOCK = 128
_DTYPE_BYTES = {DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2}
#: ``--ceilings`` keys: the user's unit, and its factor to the stored unit (bytes/s, FLOP/s).
CEILING_KEYS = {"hbm_tbps": ("hbm_bytes_per_s", 1e12), "bf16_tflops": ("bf16_flops", 1e12),
                "fp8_tflops": ("fp8_flops", 1e12)}


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """What the device sustains: HBM bytes/s, and dense matmul FLOP/s in bf16 and fp8.

    ``fp8_flops`` is None where fp8 matmuls do not run (GPUs before Hopper/MI300); the floors
    of fp8 buckets then have no compute part. ``copy_bytes_per_s`` and ``read_bytes_per_s`` are
    the two bandwidth measurements ``hbm_bytes_per_s`` is the better of (None when given by hand).
    """

    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float | None = None
    copy_bytes_per_s: float | None = None
    read_bytes_per_s: float | None = None

    def to_dict(self) -> dict[str, float]:
        """The form a tuning run stores (``tuning_run.ceilings``), without empty fields."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Ceilings:
        """Read the stored form back; unknown keys (from a newer moetune) are ignored.

        Raises:
            ValueError: If a required ceiling is missing or not a positive number.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in values.items() if k in fields}
        for name in ("hbm_bytes_per_s", "bf16_flops"):
            if name not in kept:
                raise ValueError(f"ceilings need {name}; got {sorted(values)}")
        for name, value in kept.items():
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"ceiling {name} must be a positive number, got {value!r}")
        return cls(**kept)

    def describe(self) -> str:
        """``HBM 4.28 TB/s, bf16 774 TFLOP/s, fp8 1410 TFLOP/s``."""
        parts = [f"HBM {self.hbm_bytes_per_s / 1e12:.2f} TB/s",
                 f"bf16 {self.bf16_flops / 1e12:.0f} TFLOP/s"]
        if self.fp8_flops:
            parts.append(f"fp8 {self.fp8_flops / 1e12:.0f} TFLOP/s")
        return ", ".join(parts)


def parse_ceilings(text: str) -> Ceilings:
    """``hbm_tbps=4.28,bf16_tflops=774,fp8_tflops=1410`` (``--ceilings``) as :class:`Ceilings`.

    Raises:
        FormatError: An unknown key, a value that is not a positive number, or a missing
            ``hbm_tbps`` / ``bf16_tflops``; the message lists the keys.
    """
    keys = ", ".join(CEILING_KEYS)
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key.strip() not in CEILING_KEYS:
            raise FormatError(f"--ceilings: unknown key {key.strip()!r}; use {keys}")
        name, factor = CEILING_KEYS[key.strip()]
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not number > 0:
            raise FormatError(f"--ceilings: {key.strip()} needs a positive number, got {value!r}")
        values[name] = number * factor
    try:
        return Ceilings.from_dict(values)
    except ValueError:
        raise FormatError(f"--ceilings needs at least hbm_tbps and bf16_tflops (keys: {keys}), "
                          f"e.g. hbm_tbps=4.28,bf16_tflops=774,fp8_tflops=1410") from None


@dataclasses.dataclass(frozen=True)
class Floors:
    """A bucket's floors in microseconds; ``compute_us`` is None where no matmul rate of its
    GEMM dtype is known (float32, or fp8 on a device without fp8 matmuls)."""

    hbm_us: float
    compute_us: float | None

    @property
    def roofline_us(self) -> float | None:
        """The larger floor; None when the compute floor is unknown (the HBM floor alone would
        flatter compute-bound buckets)."""
        return None if self.compute_us is None else max(self.hbm_us, self.compute_us)


def expert_bytes(problem: MoEProblem) -> int:
    """Bytes of one expert's weights as the kernels read them: W13 (gate and up, or up alone
    when ungated) and W2, in the layer's dtype or fp8 plus their float32 scales."""
    h, i = problem.hidden_size, problem.intermediate_size
    n13 = 2 * i if problem.gated else i
    if problem.quant is QuantScheme.NONE:
        return (n13 * h + h * i) * _DTYPE_BYTES[problem.dtype]
    scales = {QuantScheme.FP8_PER_TENSOR: 1 + 1,
              QuantScheme.FP8_PER_CHANNEL: n13 + h,
              QuantScheme.FP8_BLOCK_128X128: _blocks(n13) * _blocks(h) + _blocks(h) * _blocks(i)}
    return n13 * h + h * i + 4 * scales[problem.quant]


def _blocks(n: int) -> int:
    return -(-n // _BLOCK)


def expected_experts_hit(problem: MoEProblem) -> float:
    """Experts a batch routes to on average under uniform routing: each token picks ``topk``
    distinct experts of ``num_experts``, so one expert is missed by all tokens with
    probability ``(1 - topk/E) ** num_tokens``."""
    e, k, m = problem.num_experts, problem.topk, problem.num_tokens
    return e * (1.0 - (1.0 - k / e) ** m)


def floors_us(problem: MoEProblem, ceilings: Ceilings,
              experts_hit: float | None = None) -> Floors:
    """The HBM and compute floors of ``problem``.

    Args:
        problem: The bucket.
        ceilings: The device's ceilings.
        experts_hit: Experts the timed batches routed to, on average (``bench_decode``
            counts them); None: the expectation under uniform routing.
    """
    h, i, m = problem.hidden_size, problem.intermediate_size, problem.num_tokens
    hit = expected_experts_hit(problem) if experts_hit is None else experts_hit
    activations = 2 * m * h * _DTYPE_BYTES[problem.dtype]  # tokens in, tokens out
    hbm = (hit * expert_bytes(problem) + activations) / ceilings.hbm_bytes_per_s
    if problem.quant.is_fp8:
        rate = ceilings.fp8_flops
    else:
        rate = None if problem.dtype is DType.FLOAT32 else ceilings.bf16_flops
    flops = 2 * m * problem.topk * (3 if problem.gated else 2) * h * i
    return Floors(hbm * 1e6, None if not rate else flops / rate * 1e6)


def measure_ceilings(device: str = "cuda") -> Ceilings:
    """Measure the ceilings of a CUDA (or ROCm) device, in about two seconds and 5 GiB.

    HBM bandwidth: the better of a 1 GiB copy (bytes read + written) and a 2 GiB read-only sum
    (expert weights are only read, and reads stream faster than copies); bf16 and fp8 matmul
    rates on 8192^3. Times are medians of 10 event-timed calls after 3 warm-up calls.

    Raises:
        RuntimeError: CUDA is not available, or a measurement failed (out of memory, say). An
            fp8 matmul the device cannot run leaves ``fp8_flops`` None instead.
    """
    import torch

    with torch.cuda.device(torch.device(device)):
        src = torch.ones(1 << 30, dtype=torch.uint8, device=device)
        copy = 2 * src.numel() / _seconds(torch.empty_like(src).copy_, src)
        src = torch.ones(1 << 29, dtype=torch.float32, device=device)
        read = 4 * src.numel() / _seconds(src.sum)
        del src
        n = 8192
        x = torch.randn(n, n, device=device).bfloat16()
        y = torch.randn(n, n, device=device).bfloat16()
        bf16 = 2 * n ** 3 / _seconds(torch.matmul, x, y)
        try:
            x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t()
            one = torch.ones((), device=device)
            fp8: float | None = 2 * n ** 3 / _seconds(
                torch._scaled_mm, x8, y8, one, one, out_dtype=torch.bfloat16)
        except (RuntimeError, TypeError):  # no fp8 matmul on this device or torch
            fp8 = None
        del x, y
        torch.cuda.empty_cache()
    return Ceilings(max(copy, read), bf16, fp8, copy, read)


def _seconds(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    import torch

    for _ in range(3):
        fn(*args, **kwargs)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args, **kwargs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e-3


def measure_if_cuda(device: str) -> Ceilings | None:
    """The ceilings a tuning run on ``device`` records: measured on CUDA, None elsewhere (the
    CPU has no such measurement)."""
    return measure_ceilings(device) if device.startswith("cuda") else None
