#!/usr/bin/env bash
# Third run: as the second, with 4 test workers (8 ran an 80 GB card out of memory once), the
# probe at Mixtral-8x7B and Qwen3-30B-A3B, and re-tunes of their prefill buckets, into a copy
# of the shipped table on an H200 (else into a new table for the GPU it ran on).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run3.txt
cat $OUT/gpu-run3.txt
echo "commit $COMMIT" > $OUT/cuda-tests.txt
start=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 --junitxml=$OUT/cuda-tests.xml \
  tests/test_kernels_cuda.py tests/test_kernel_contract.py >> $OUT/cuda-tests.txt 2>&1
echo "pytest exit $? after $(( $(date +%s) - start )) s" | tee -a $OUT/cuda-tests.txt
tail -2 $OUT/cuda-tests.txt
timeout 100 python3 scripts/probe_grouped_mm.py --commit $COMMIT --cases mixtral-8x7b:512,mixtral-8x7b:1024,mixtral-8x7b:2048,mixtral-8x7b:4096,qwen3-30b-a3b:3072,qwen3-30b-a3b:4096 \
  > $OUT/probe-grouped-mm.md 2> $OUT/probe-grouped-mm.err
echo "probe exit $?"; cat $OUT/probe-grouped-mm.md
grep -q H200 $OUT/gpu-run3.txt && cp runtime/tables/nvidia_H200.db $OUT/tune.db
for job in mixtral-8x7b:4096,2048,1024,512,3072,1536,256:300 qwen3-30b-a3b:4096,3072:100; do
  preset=${job%%:*}; rest=${job#*:}; buckets=${rest%%:*}; limit=${rest#*:}
  timeout $limit moetune tune --preset $preset --device cuda --output $OUT/tune.db \
    --buckets $buckets --trials 12 --seed 7 > $OUT/tune-$preset.log 2>&1
  echo "$preset tune exit $?"; grep -E "^M=" $OUT/tune-$preset.log | cut -c1-120
done
rm -rf $OUT/.tune.db.locks
