#!/usr/bin/env bash
# FlashInfer's Hopper fused-MoE module (fused_moe_90: 248 compile units, about 13 CPU-hours of nvcc,
# bench/results/flashinfer-build-cpu-2026-12-07) built on a machine without a GPU, with FlashInfer's
# own JIT spec and build, and kept for the GPU machine (scripts/flashinfer_module.sh keep: there,
# AOT=OUTDIR bash scripts/device_flashinfer.sh loads it instead of building). What FlashInfer's
# prebuilt cache (flashinfer-jit-cache) would give, for a GPU machine held too briefly to build.
# Resumable: ninja keeps each object in WS, so a stopped build goes on where it stopped. It runs
# at nice 19, so the rest of the machine's work comes first.
#   CUDA_HOME=DIR [WS=DIR] [JOBS=2] [PYTHON=python3] bash scripts/flashinfer_aot_build.sh OUTDIR
# CUDA_HOME holds bin/nvcc (13.0), the CUDA headers and lib64/ with libcudart.so, libnvrtc.so and
# stubs/libcuda.so for the link (scripts/flashinfer_build_cost.py says which pip wheels make it,
# nvidia-curand's headers among them; libnvrtc is nvidia-cuda-nvrtc's, and a stub with the soname
# libcuda.so.1 stands for the driver, which the GPU machine has); flashinfer and apache-tvm-ffi
# import (PYTHONPATH) and ninja runs.
set -eu
out=${1:?OUTDIR}
export FLASHINFER_WORKSPACE_BASE=${WS:-/tmp/flashinfer-aot} FLASHINFER_CUDA_ARCH_LIST=9.0a
export CUDA_HOME MAX_JOBS=${JOBS:-2}
nice -n 19 "${PYTHON:-python3}" - <<'PY'
import time

from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

spec = gen_cutlass_fused_moe_sm90_module()
start = time.perf_counter()
spec.build(verbose=False)
print(f"{spec.name} built in {time.perf_counter() - start:.0f} s", flush=True)
PY
bash "$(dirname "$0")/flashinfer_module.sh" keep "$out"
