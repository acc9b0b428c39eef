"""GEMM2's reduce cost at large M: the table winner's params with REDUCE atomic_out, sum, and
plain stores (wrong sums, pure GEMM time), launch by launch."""
import sys, json
import torch
sys.path.insert(0, "scripts")
from profile_moe import launches, CALLS
from moetune.runtime.dispatcher import Dispatcher, shipped_table
from moetune.runtime.platform import detect_sku
from moetune.runtime.registry import default_registry
from moetune.runtime.kernels import _grouped
from moetune.tuner.inputs import make_batch, make_weights
from moetune.tuner.presets import preset
sku = detect_sku("cuda")
table = Dispatcher.load(shipped_table(sku), sku)
kernel = default_registry.get("moetune_grouped")
for case in sys.argv[1].split(","):
    name, tokens = case.split(":")
    problem = preset(name).shape.problem(int(tokens))
    weights = make_weights(problem, "cuda", seed=0)
    inputs = [make_batch(problem, "cuda", seed=i).args() for i in range(CALLS)]
    chosen = table.select(problem)
    params = dict(chosen.params) if chosen.kernel == "moetune_grouped" else None
    if params is None:
        params = kernel.seed_params(problem, sku)
    print(f"## {case} {chosen.kernel} base {json.dumps(params)}")
    for label, over, store in (("atomic_out", {"REDUCE": "atomic_out"}, False),
                               ("atomic", {"REDUCE": "atomic"}, False),
                               ("sum", {"REDUCE": "sum"}, False),
                               ("store(no reduce)", {"REDUCE": "atomic_out"}, True)):
        p = {**params, **over}
        _grouped.ATOMIC = _grouped.STORE if store else 1
        fn = kernel.prepare(problem, p, weights)
        rows = sorted(launches(fn, inputs).items(), key=lambda kv: -kv[1][1])
        total = sum(us for _, (_, us) in rows)
        print(f"- {label}: {total:.1f} us: " + ", ".join(f"{n[:28]} {us:.1f}" for n, (_, us) in rows))
        sys.stdout.flush()
    _grouped.ATOMIC = 1
    del weights, inputs
    torch.cuda.empty_cache()
