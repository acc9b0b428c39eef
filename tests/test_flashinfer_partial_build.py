"""``scripts/flashinfer_partial_build.py``: which of FlashInfer's units a dtype needs, and the
stubs that let a module built without the others link and load, and fail loudly if called."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import flashinfer_partial_build as partial  # noqa: E402

INSTANCE = "INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM(Sm90, {a}, {a}, {o}, void, 128, 16, 64);\n"


def generated(tmp_path: Path, name: str, *pairs: tuple[str, str]) -> Path:
    path = tmp_path / f"cutlass_kernel_file_{name}.generated.cu"
    path.write_text('#include "launcher.inl"\n' + "".join(INSTANCE.format(a=a, o=o) for a, o in pairs))
    return path


def test_a_dtype_keeps_its_grouped_instantiations_and_runner_and_nothing_of_the_others(tmp_path):
    bf16 = generated(tmp_path, "gemm_grouped_sm90_M128_group7", ("__nv_bfloat16", "__nv_bfloat16"))
    fp16 = generated(tmp_path, "gemm_grouped_sm90_M128_group0", ("half", "half"))
    fp32 = generated(tmp_path, "gemm_grouped_sm90_M256_group4", ("float", "float"))
    fp8 = generated(tmp_path, "gemm_grouped_sm90_M128_group21",
                    ("__nv_fp8_e4m3", "half"), ("__nv_fp8_e4m3", "__nv_bfloat16"))
    mixed = generated(tmp_path, "gemm_grouped_sm90_M128_Mixed_group3", ("__nv_bfloat16", "__nv_bfloat16"))
    # Ampere's fused gated kernels, which Hopper's tactics include: CUTLASS's type names, mixed.
    ampere_both = generated(tmp_path, "gemm_grouped_sm80_M16_group1",
                            ("cutlass::bfloat16_t", "cutlass::bfloat16_t"), ("cutlass::half_t", "cutlass::half_t"))
    ampere_fp16 = generated(tmp_path, "gemm_grouped_sm80_M16_group0", ("cutlass::half_t", "cutlass::half_t"))
    dense = generated(tmp_path, "gemm_sm90_M64_group1", ("__nv_bfloat16", "__nv_bfloat16"))
    runners = {d: Path(f"/csrc/moe_gemm/moe_gemm_kernels_{d}.cu")
               for d in ("bf16_bf16", "fp8_fp8", "bf16_fp8", "fp16_fp16", "bf16_uint4")}
    shared = [Path("/csrc/fp8_blockscale_gemm.cu"), Path("/csrc/flashinfer_cutlass_fused_moe_binding.cu")]

    def kept(*dtypes: str) -> set[Path]:
        units = [bf16, fp16, fp32, fp8, mixed, dense, ampere_both, ampere_fp16, *runners.values(),
                 *shared]
        return {u for u in units if partial.wanted(u, list(dtypes))}

    assert kept("bf16") == {bf16, ampere_both, runners["bf16_bf16"], *shared}
    # The fp8 files name their fp16/bf16 outputs too: they go with fp8, not with bf16 or fp16.
    assert kept("fp8") == {fp8, runners["fp8_fp8"], *shared}
    # Block fp8 runs the block-scale GEMM in the bf16-by-fp8 runner: no grouped instantiation.
    assert kept("fp8-block") == {runners["bf16_fp8"], *shared}
    assert kept("fp16", "bf16", "fp8") == {bf16, fp16, fp8, ampere_both, ampere_fp16, *shared} | {
        runners[d] for d in ("bf16_bf16", "fp8_fp8", "fp16_fp16")}


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to link a library")
def test_stubs_define_what_the_left_out_units_would_and_abort_naming_it(tmp_path):
    """A library calling a function of the module's namespaces that no unit defines: that
    symbol (not libc's) is found undefined, the stubs define it, and calling it aborts."""
    (tmp_path / "uses.cpp").write_text(
        "#include <cstring>\n"
        "namespace tensorrt_llm { namespace kernels { int launch(int); } }\n"
        'extern "C" int run(int x) { return tensorrt_llm::kernels::launch(x) + (int)strlen("a"); }\n'
        'extern "C" int fine(int x) { return x + 1; }\n')
    lib = tmp_path / "libuses.so"

    def link(*sources: Path) -> None:
        subprocess.run(["g++", "-shared", "-fPIC", "-o", str(lib), *map(str, sources)], check=True)

    link(tmp_path / "uses.cpp")
    missing = partial.undefined_own_symbols(lib)
    assert missing == ["_ZN12tensorrt_llm7kernels6launchEi"]
    stubs = tmp_path / "unbuilt_kernels.cpp"
    partial.write_stubs(stubs, missing)
    link(tmp_path / "uses.cpp", stubs)
    assert partial.undefined_own_symbols(lib) == []
    # It loads with every symbol bound now; what was built runs, what was not aborts loudly.
    assert ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL).fine(41) == 42
    call = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(lib)!r}).run(1)"],
                          capture_output=True, text=True)
    assert call.returncode != 0
    assert "built without the unit defining _ZN12tensorrt_llm7kernels6launchEi" in call.stderr
