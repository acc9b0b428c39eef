"""Run GEMM1 of aiter's fused-SiLU kernel (the shipped table's row) and moetune_grouped's at the
same work per program (TMA and pointer weights) at one bucket, a few calls each, for Nsight
Compute: `ncu -k regex:'_gemm1_act|silu_kernel' python ncu_gemm1.py qwen3-30b-a3b:4096`."""
import sys

import torch

from moetune.runtime.dispatcher import Dispatcher, shipped_table
from moetune.runtime.platform import detect_sku
from moetune.runtime.registry import default_registry
from moetune.tuner.inputs import make_batch, make_weights
from moetune.tuner.presets import preset

name, tokens = sys.argv[1].split(":")
problem = preset(name).shape.problem(int(tokens))
sku = detect_sku("cuda")
chosen = Dispatcher.load(shipped_table(sku), sku).select(problem)
weights = make_weights(problem, "cuda", seed=0)
args = make_batch(problem, "cuda", seed=1).args()
grouped = default_registry.get("moetune_grouped")
runs = [(chosen.kernel, dict(chosen.params))]
if chosen.kernel != "moetune_grouped":
    g1, g2 = default_registry.get(chosen.kernel).gemm_configs(problem, chosen.params)
    same = grouped.from_gemm_configs(problem, g1, g2)
    runs += [("moetune_grouped", same), ("moetune_grouped", {**same, "W_TMA": 0})]
for kernel, params in runs:
    params = default_registry.get(kernel).validate(params)
    print(kernel, params, flush=True)
    fn = default_registry.get(kernel).prepare(problem, params, weights)
    for _ in range(2):
        fn(*args)
    torch.cuda.synchronize()
