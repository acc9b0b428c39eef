"""Activation fp8 quantization side by side: one row per program (as before) against
``quantize_rows`` (several narrow rows per program), at the activations of the presets' large
buckets. Median of CUDA-graph replays (``triton.testing.do_bench_cudagraph``).

Run on the GPU: python bench_quant.py > quant.md"""
import torch
import triton
from triton.testing import do_bench_cudagraph

from moetune.runtime.kernels._act_quant import _FP8_MAX, FP8, _quant_kernel, quantize_rows

CASES = [("DeepSeek-V3 4096: GEMM2 input", 32768, 256, 128),
         ("DeepSeek-V3 4096: GEMM1 input", 4096, 7168, 128),
         ("DeepSeek-V3 512: GEMM2 input", 4096, 256, 128),
         ("Llama-4-Maverick 4096: GEMM2 input", 4096, 1024, None),
         ("Llama-4-Maverick 4096: GEMM1 input", 4096, 5120, None)]


def one_row_per_program(x, group):
    rows, cols = x.shape
    group = group or cols
    groups = cols // group
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    width = triton.next_power_of_2(groups) * triton.next_power_of_2(group)
    _quant_kernel[(rows,)](x, q, scale, rows, x.stride(0), ROWS=1, GROUPS=groups, GROUP=group,
                           GROUPS_POW2=triton.next_power_of_2(groups),
                           GROUP_POW2=triton.next_power_of_2(group), FP8_MAX=_FP8_MAX,
                           num_warps=8 if width >= 8192 else 4)
    return q, scale


print(f"# Activation quantization on {torch.cuda.get_device_name()}, triton {triton.__version__}\n")
print("| activation | rows x cols | one row per program us | several rows us | speedup |")
print("|---|---|---|---|---|")
for label, rows, cols, group in CASES:
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    a, b = one_row_per_program(x, group), quantize_rows(x, group)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0].float(), b[0].float())
    old = do_bench_cudagraph(lambda: one_row_per_program(x, group), rep=100)
    new = do_bench_cudagraph(lambda: quantize_rows(x, group), rep=100)
    print(f"| {label} | {rows} x {cols} | {old * 1e3:.1f} | {new * 1e3:.1f} | {old / new:.2f}x |")
