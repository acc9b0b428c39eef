#!/usr/bin/env bash
# Second run, on the H200: the CUDA kernel and contract tests (8 pytest-xdist workers; per-test
# results in the JUnit file), the probe against the shipped table's winners, then re-tunes of
# the buckets where moetune_grouped_mm may win, into a copy of the shipped table.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run2.txt
cat $OUT/gpu-run2.txt
echo "commit $COMMIT" > $OUT/cuda-tests-h200.txt
start=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 --junitxml=$OUT/cuda-tests-h200.xml \
  tests/test_kernels_cuda.py tests/test_kernel_contract.py >> $OUT/cuda-tests-h200.txt 2>&1
echo "pytest exit $? after $(( $(date +%s) - start )) s" | tee -a $OUT/cuda-tests-h200.txt
tail -2 $OUT/cuda-tests-h200.txt
timeout 120 python3 scripts/probe_grouped_mm.py --commit $COMMIT > $OUT/probe-grouped-mm.md \
  2> $OUT/probe-grouped-mm.err
echo "probe exit $?"; cat $OUT/probe-grouped-mm.md
cp runtime/tables/nvidia_H200.db $OUT/tune.db
for job in mixtral-8x7b:4096,2048,1024,512:170 qwen3-30b-a3b:4096,3072:60; do
  preset=${job%%:*}; rest=${job#*:}; buckets=${rest%%:*}; limit=${rest#*:}
  timeout $limit moetune tune --preset $preset --device cuda --output $OUT/tune.db \
    --buckets $buckets --trials 12 --seed 7 > $OUT/tune-$preset.log 2>&1
  echo "$preset tune exit $?"; grep -E "^M=" -A3 $OUT/tune-$preset.log | grep -o "^M=[0-9]*\|[0-9.]*us vs.*s ("
done
rm -rf $OUT/.tune.db.locks
