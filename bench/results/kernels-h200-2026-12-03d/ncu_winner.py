"""Run the shipped table's winner at one or more buckets, two calls each, for Nsight Compute:
`ncu -k regex:'_gemm1_act|_gemm2_reduce' python ncu_winner.py deepseek-v3:4096 ...`."""
import sys

import torch

from moetune.runtime.dispatcher import Dispatcher, shipped_table
from moetune.runtime.platform import detect_sku
from moetune.runtime.registry import default_registry
from moetune.tuner.inputs import make_batch, make_weights
from moetune.tuner.presets import preset

sku = detect_sku("cuda")
table = Dispatcher.load(shipped_table(sku), sku)
for case in sys.argv[1:]:
    name, tokens = case.split(":")
    problem = preset(name).shape.problem(int(tokens))
    chosen = table.select(problem)
    print(case, chosen.kernel, dict(chosen.params), flush=True)
    weights = make_weights(problem, "cuda", seed=0)
    args = make_batch(problem, "cuda", seed=1).args()
    fn = default_registry.get(chosen.kernel).prepare(problem, chosen.params, weights)
    for _ in range(2):
        fn(*args)
    torch.cuda.synchronize()
    del weights, args, fn
    torch.cuda.empty_cache()
