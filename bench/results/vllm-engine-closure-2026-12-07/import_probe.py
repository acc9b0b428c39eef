"""Import vLLM 0.34's offline-engine modules as on the CUDA platform, on a CPU machine: the
compiled vLLM libraries are stubbed (``vllm._C_stable_libtorch``, ``vllm._moe_C_stable_libtorch``
and those in ``STUB_EXTRA``, comma-separated) and every compiled library asked for is logged;
the current platform is forced to CUDA, answering import-time device queries as a Hopper GPU.
Prints each module's import result, then every third-party distribution loaded and the
``sys.path`` entry it came from.

    STUB_EXTRA=vllm.vllm_flash_attn._vllm_fa3_C PYTHONPATH=<wheels> python import_probe.py \
        $(python scripts/vllm_sources.py 0.34.0) [module ...]
"""
import importlib, importlib.abc, importlib.machinery, importlib.metadata, sys, types, traceback, os

SRC = sys.argv[1]
sys.path.insert(0, SRC)
STUB = {"vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch"} | set(os.environ.get("STUB_EXTRA", "").split(",")) - {""}
asked = []

class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name in STUB:
            asked.append(("stubbed", name))
            return importlib.machinery.ModuleSpec(name, self)
        if name.startswith("vllm.") and name.split(".")[-1].startswith("_") and name.endswith("_C"):
            asked.append(("compiled, absent", name))
        return None
    def create_module(self, spec):
        return types.ModuleType(spec.name)
    def exec_module(self, module):
        pass

sys.meta_path.insert(0, Finder())
import torch
# A Hopper GPU as far as import-time queries go (torch's CPU build answers none of them).
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H100 80GB HBM3"
class _Ops:
    """Stands in for the op namespaces the stubbed libraries register: every op returns False."""
    def __getattr__(self, name):
        return lambda *a, **k: False
for ns in ("_C", "_moe_C", "_C_cache_ops", "_C_custom_ar"):
    setattr(torch.ops, ns, _Ops())
def _register_fake(op, fn=None, **kwargs):  # the stubbed libraries registered no ops to fake
    return (lambda f: f) if fn is None else fn
torch.library.register_fake = _register_fake
import vllm.platforms as P
from vllm.platforms.cuda import NonNvmlCudaPlatform
P._current_platform = NonNvmlCudaPlatform()
print("platform:", type(P.current_platform).__name__, "is_cuda", P.current_platform.is_cuda())

TARGETS = sys.argv[2:] or [
    "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu.model_runner", "vllm.v1.attention.backends.triton_attn",
    "vllm.model_executor.model_loader.dummy_loader",
    "vllm.model_executor.models.mixtral", "vllm.model_executor.models.qwen3_moe",
]
for t in TARGETS:
    try:
        importlib.import_module(t)
        print("ok  ", t)
    except BaseException as e:
        tb = traceback.extract_tb(e.__traceback__)
        where = " <- ".join(f"{os.path.relpath(f.filename, SRC) if f.filename.startswith(SRC) else os.path.basename(f.filename)}:{f.lineno}" for f in tb[-6:] if "importlib" not in f.filename)
        print("FAIL", t, f"{type(e).__name__}: {e}", "\n      at", where)
print("compiled modules asked for:", sorted(set(asked)))
dists = importlib.metadata.packages_distributions()
loaded = {}
for name, mod in list(sys.modules.items()):
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top in ("vllm", "__main__") or top.startswith("_"):
        continue
    f = getattr(mod, "__file__", None) or ""
    where = max((p for p in sys.path if p and f.startswith(p)), key=len, default="")
    for d in dists.get(top, [top]):
        loaded.setdefault(d, where)
print("distributions loaded:", len(loaded))
for d, w in sorted(loaded.items(), key=lambda x: x[0].lower()):
    print(f"  {d:28s} {w}")
