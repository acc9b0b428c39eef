"""Which Hopper features the installed Triton compiles and runs on this GPU: tensor-memory
(TMA) descriptors made on the host and in the kernel, and warp-specialized loops. moetune's
kernels use a feature only where this says it works.

Usage: python scripts/probe_triton.py > probe.md

Each probe is a 256x256x256 bf16 matmul in one feature's style, checked against torch and
timed against the plain-pointer version of itself at 4096^3 (median of triton.testing.do_bench).
"""

from __future__ import annotations

import sys
import traceback
from typing import Callable

import torch
import triton
import triton.language as tl

BM, BN, BK = 128, 128, 64


@triton.jit
def _plain(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + rn[:, None] * K + (k + rk)[None, :])
        acc = tl.dot(a, b.T, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


@triton.jit
def _host_desc(a_desc, b_desc, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        a = a_desc.load([pid_m * BM, k])
        b = b_desc.load([pid_n * BN, k])
        acc = tl.dot(a, b.T, acc)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


@triton.jit
def _device_desc(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BN, BK])
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        acc = tl.dot(a_desc.load([pid_m * BM, k]), b_desc.load([pid_n * BN, k]).T, acc)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


@triton.jit
def _warp_spec(a_desc, b_desc, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K, BK, warp_specialize=True):
        acc = tl.dot(a_desc.load([pid_m * BM, k]), b_desc.load([pid_n * BN, k]).T, acc)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


def _launcher(style: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from triton.tools.tensor_descriptor import TensorDescriptor

    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        m, k = a.shape
        n = b.shape[0]
        c = torch.empty(m, n, dtype=a.dtype, device=a.device)
        grid = (m // BM, n // BN)
        opts = dict(BM=BM, BN=BN, BK=BK, num_warps=8, num_stages=3)
        if style == "plain":
            _plain[grid](a, b, c, m, n, k, **opts)
        elif style == "device":
            _device_desc[grid](a, b, c, m, n, k, **opts)
        else:
            kernel = _host_desc if style == "host" else _warp_spec
            kernel[grid](TensorDescriptor.from_tensor(a, [BM, BK]),
                         TensorDescriptor.from_tensor(b, [BN, BK]), c, m, n, k, **opts)
        return c
    return run


def main() -> int:
    # In-kernel descriptors live in global scratch memory the launcher must allocate.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    print(f"# Triton {triton.__version__} on {torch.cuda.get_device_name()}\n")
    print("| probe | runs and matches torch | 4096^3 TFLOP/s | vs plain pointers |")
    print("|---|---|---|---|")
    plain_ms = None
    for style in ("plain", "host", "device", "warp_specialize"):
        fn = _launcher(style)
        try:
            a = torch.randn(256, 256, device="cuda").bfloat16()
            b = torch.randn(256, 256, device="cuda").bfloat16()
            err = (fn(a, b).float() - a.float() @ b.float().T).abs().max().item()
            ok = err < 0.5
            a = torch.randn(4096, 4096, device="cuda").bfloat16()
            b = torch.randn(4096, 4096, device="cuda").bfloat16()
            ms = triton.testing.do_bench(lambda: fn(a, b))
            plain_ms = plain_ms or ms
            print(f"| {style} | {'yes' if ok else f'no: max error {err:.3g}'} | "
                  f"{2 * 4096 ** 3 / ms / 1e9:.0f} | {plain_ms / ms:.2f}x |")
        except Exception as e:  # noqa: BLE001 - a feature that fails is the result
            print(f"| {style} | no: {type(e).__name__}: {str(e).splitlines()[0][:160]} | - | - |")
            traceback.print_exc(file=sys.stderr)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
