#!/usr/bin/env bash
# Fourth H200 run: the CUDA kernel and contract tests at the final kernel code.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run4.txt
echo "commit $COMMIT" > $OUT/cuda-tests.txt
timeout 520 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py tests/test_kernel_contract.py \
  >> $OUT/cuda-tests.txt 2>&1
echo "pytest exit $?"; tail -3 $OUT/cuda-tests.txt
