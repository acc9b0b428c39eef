# The control for tests/test_kernels_cuda.py::test_a_kernel_that_says_it_repeats_...: the same
# calls with configurations that run_to_run says may vary. Run from the project root on the GPU:
#   PYTHONPATH=$PWD:$HOME/site python3 bench/results/determinism-h100-2026-12-07/control.py
import torch, dataclasses
from tests.test_kernels_cuda import TOP8, _params
from moetune.runtime.registry import default_registry
from moetune.runtime.platform import detect_sku
from moetune.tuner.inputs import Routing, make_batch, make_weights
sku = detect_sku("cuda")
for name, problem, o in [("moetune_grouped", TOP8, {"REDUCE": "atomic_out"}), ("moetune_grouped", TOP8, {"REDUCE": "atomic"}), ("moetune_grouped", TOP8, {"REDUCE": "sum"}), ("moetune_decode", dataclasses.replace(TOP8, num_tokens=4), {"REDUCE": "atomic", "SPLIT_K": 2, "g2_BLOCK_K": 128})]:
    k = default_registry.get(name)
    p = k.validate({**_params(name, problem), **o})
    w = make_weights(problem, "cuda", seed=1); b = make_batch(problem, "cuda", seed=2, routing=Routing.ZIPF).args()
    fn = k.prepare(problem, p, w); first = fn(*b).clone()
    diff = sum(not torch.equal(fn(*b), first) for _ in range(20))
    print(name, o, "run_to_run:", k.run_to_run(problem, p), "| calls differing from the first:", diff, "of 20", flush=True)
