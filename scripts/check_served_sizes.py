"""Run a table's winners as serving runs them, at every num_tokens an engine calls with, not only
the bucket points: each distinct winner prepared once at its first bucket (``ShapePlan``), then
called at every size through the nearest bucket's choice, with the engine's output buffer, and
compared with the float32 reference. Stops at the first size that raises or is wrong, naming
the kernel, its params and the bucket it was prepared at.

    CUDA_LAUNCH_BLOCKING=1 python scripts/check_served_sizes.py --preset qwen3-30b-a3b \\
        [--table T] [--sizes 1-128,256,1000,8192,16384] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys

import torch

from moetune.runtime.dispatcher import Dispatcher, default_table
from moetune.runtime.kernels.base import WeightLayout
from moetune.runtime.plan import ShapePlan
from moetune.runtime.platform import detect_sku
from moetune.tuner.gate import relative_error
from moetune.tuner.inputs import make_batch, make_weights
from moetune.tuner.presets import preset

#: vLLM's CUDA-graph capture sizes up to 128 (1, 2, 4, then steps of 8) and prefill chunks.
DEFAULT_SIZES = "1,2,4,8-128:8,256,512,1000,2048,4096,8192,16384"
TOLERANCE = 0.08


def sizes(text: str) -> list[int]:
    """``"1,2,8-128:8"`` -> [1, 2, 8, 16, ..., 128]."""
    out: list[int] = []
    for item in text.split(","):
        span, _, step = item.partition(":")
        lo, _, hi = span.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1, int(step or 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--table", help="default: the table serving uses on this device")
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    sku = detect_sku(args.device)
    shape = preset(args.preset).shape
    dispatcher = Dispatcher.load(args.table or default_table(sku), sku)
    plan = ShapePlan.build(dispatcher, shape, WeightLayout.PLAIN)
    print(plan.summary())
    weights = make_weights(shape.problem(1), args.device)
    fns = {key: plan.registry.get(key[0]).prepare(shape.problem(m), choice.params, weights)
           for key, (m, choice) in plan.kernels().items()}
    prepared_at = {key: m for key, (m, _) in plan.kernels().items()}
    reference = plan.registry.get("reference")
    for n in sizes(args.sizes):
        choice, _ = plan.lookup(n)
        if choice.key is None:
            print(f"M={n}: {choice.label()}")
            continue
        batch = make_batch(shape.problem(n), args.device, seed=n)
        out = torch.empty_like(batch.x)
        label = f"M={n}: {choice.kernel} {choice.params} (prepared at M={prepared_at[choice.key]})"
        try:
            fns[choice.key](*batch.args(), out=out)
            if out.is_cuda:
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - the point is to name what failed
            print(f"{label}: FAILED {type(e).__name__}: {e}")
            return 1
        ref = reference.prepare(shape.problem(n), {}, weights)(*batch.args())
        err = relative_error(out, ref)
        print(f"{label}: error {err:.2e}")
        if err > TOLERANCE:
            print("WRONG")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
