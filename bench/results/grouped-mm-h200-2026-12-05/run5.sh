#!/usr/bin/env bash
# run3.sh split in two calls, each under the 600 s a command may run:
#   PHASE=tests  the CUDA tests (4 workers, JUnit record) and the probe;
#   PHASE=tune   re-tunes of Mixtral-8x7B's and Qwen3-30B-A3B's prefill buckets into a copy of
#                the shipped table (H200 only: on another GPU it stops).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run5-$PHASE.txt
cat $OUT/gpu-run5-$PHASE.txt
if [ "$PHASE" = tests ]; then
  echo "commit $COMMIT" > $OUT/cuda-tests.txt
  start=$(date +%s)
  timeout 260 python3 -m pytest -q -p no:cacheprovider -n 4 --junitxml=$OUT/cuda-tests.xml \
    tests/test_kernels_cuda.py tests/test_kernel_contract.py >> $OUT/cuda-tests.txt 2>&1
  echo "pytest exit $? after $(( $(date +%s) - start )) s" | tee -a $OUT/cuda-tests.txt
  tail -2 $OUT/cuda-tests.txt
  timeout 150 python3 scripts/probe_grouped_mm.py --commit $COMMIT --cases mixtral-8x7b:512,mixtral-8x7b:1024,mixtral-8x7b:2048,mixtral-8x7b:4096,qwen3-30b-a3b:1024,qwen3-30b-a3b:2048,qwen3-30b-a3b:3072,qwen3-30b-a3b:4096,qwen3-235b-a22b:2048,qwen3-235b-a22b:4096 \
    > $OUT/probe-grouped-mm.md 2> $OUT/probe-grouped-mm.err
  echo "probe exit $?"; cat $OUT/probe-grouped-mm.md
  exit 0
fi
grep -q H200 $OUT/gpu-run5-$PHASE.txt || { echo "not an H200: no tune"; exit 3; }
cp runtime/tables/nvidia_H200.db $OUT/tune.db
for job in mixtral-8x7b:4096,2048,1024,512,3072,1536,256:330 qwen3-30b-a3b:4096,3072:150; do
  preset=${job%%:*}; rest=${job#*:}; buckets=${rest%%:*}; limit=${rest#*:}
  timeout $limit moetune tune --preset $preset --device cuda --output $OUT/tune.db \
    --buckets $buckets --trials 12 --seed 7 > $OUT/tune-$preset.log 2>&1
  echo "$preset tune exit $?"; grep -E "^M=" $OUT/tune-$preset.log | cut -c1-120
done
rm -rf $OUT/.tune.db.locks
