#!/usr/bin/env bash
# A CUDA_HOME in which FlashInfer's fused-MoE build compiles and links on a machine without a GPU
# (scripts/flashinfer_partial_build.py, scripts/flashinfer_aot_build.sh): an installed CUDA 13.0
# toolkit (nvcc, its headers, libcudart) plus what that lacks, from pip's wheels: the headers of
# cuBLAS, cuRAND (TensorRT-LLM's reduce utilities include curand_kernel.h) and NVRTC, libnvrtc,
# and a stub libcuda.so.1 standing for the driver, which the GPU machine has. Links to the
# toolkit's files; about 600 MB of wheels downloaded once into DEST/wheels.
#   bash scripts/flashinfer_cuda_home.sh DEST [TOOLKIT=/usr/local/cuda-13.0]
set -euo pipefail
dest=$(realpath -m "${1:?DEST}")
toolkit=${2:-/usr/local/cuda-13.0}
[ -x "$toolkit/bin/nvcc" ] || { echo "no nvcc in $toolkit/bin"; exit 1; }
"$toolkit/bin/nvcc" --version | grep -q "release 13.0" || { echo "$toolkit is not CUDA 13.0"; exit 1; }
[ -e "$dest/lib64/stubs/libcuda.so.1" ] && { echo "CUDA_HOME=$dest"; exit 0; }

mkdir -p "$dest/include" "$dest/lib64/stubs" "$dest/wheels"
for d in bin nvvm targets; do ln -sfn "$toolkit/$d" "$dest/$d"; done
for e in "$toolkit"/include/* "$toolkit"/lib64/*; do
  ln -sfn "$e" "$dest/$(basename "$(dirname "$e")")/$(basename "$e")"
done
for p in "nvidia-cublas>=13,<14" "nvidia-cuda-nvrtc>=13.0,<13.1" "nvidia-curand>=10.4,<10.5"; do
  python3 -m pip download -q --no-deps --only-binary=:all: "$p" -d "$dest/wheels" 2>&1 \
    | grep -v "is ignored: it is neither" || true
done
for w in "$dest"/wheels/*.whl; do unzip -q -o "$w" 'nvidia/*' -d "$dest/wheels/x"; done
for e in "$dest"/wheels/x/nvidia/cu13/include/*; do
  [ -e "$dest/include/$(basename "$e")" ] || ln -s "$e" "$dest/include/"
done
ln -sfn "$dest/wheels/x/nvidia/cu13/lib/libnvrtc.so.13" "$dest/lib64/libnvrtc.so.13"
ln -sfn libnvrtc.so.13 "$dest/lib64/libnvrtc.so"
# The link only needs the soname; the module calls the driver through libcudart at run time.
echo 'int cuDriverGetVersion(int* v) { *v = 0; return 0; }' > "$dest/lib64/stubs/cuda_stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$dest/lib64/stubs/libcuda.so" "$dest/lib64/stubs/cuda_stub.c"
ln -sfn libcuda.so "$dest/lib64/stubs/libcuda.so.1"
echo "CUDA_HOME=$dest"
