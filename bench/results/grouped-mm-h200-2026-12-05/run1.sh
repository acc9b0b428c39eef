#!/usr/bin/env bash
# First H200 run: the CUDA kernel and contract tests at this commit (spread over 8 pytest-xdist
# workers, carried as wheels), then torch's CUTLASS grouped GEMMs against the table's winners.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run1.txt
echo "commit $COMMIT" > $OUT/cuda-tests-h200.txt
start=$(date +%s)
timeout 330 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels_cuda.py \
  tests/test_kernel_contract.py >> $OUT/cuda-tests-h200.txt 2>&1
echo "pytest exit $? after $(( $(date +%s) - start )) s" | tee -a $OUT/cuda-tests-h200.txt
tail -3 $OUT/cuda-tests-h200.txt
timeout 200 python3 scripts/probe_grouped_mm.py --commit $COMMIT > $OUT/probe-grouped-mm.md \
  2> $OUT/probe-grouped-mm.err
echo "probe exit $?"; cat $OUT/probe-grouped-mm.md; tail -5 $OUT/probe-grouped-mm.err
