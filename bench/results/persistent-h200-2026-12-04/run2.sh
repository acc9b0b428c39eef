#!/usr/bin/env bash
# Second H200 run: re-tune DeepSeek-V3 at 2048-4096 tokens (where g2_PERSISTENT won side by side)
# into a copy of the shipped table, then the CUDA kernel suite. Run from the repository root.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run2.txt
cp runtime/tables/nvidia_H200.db $OUT/tune.db
timeout 220 moetune tune --preset deepseek-v3 --device cuda --output $OUT/tune.db \
  --buckets 2048,3072,4096 --trials 12 > $OUT/tune-deepseek-v3.log 2>&1
echo "tune exit $?"; grep -E "^M=" $OUT/tune-deepseek-v3.log | cut -c1-400
timeout 340 python3 -m pytest -q tests/test_kernels_cuda.py tests/test_kernel_contract.py > $OUT/cuda-tests.txt 2>&1
tail -n 3 $OUT/cuda-tests.txt
