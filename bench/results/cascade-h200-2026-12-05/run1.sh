#!/usr/bin/env bash
# H200 re-tunes (sampler seed 7, each search also measuring the table's winners at the
# neighbouring num_tokens) at the buckets whose neighbours changed in the last re-tunes
# (DeepSeek-V3 1024 and 2048 beside 1536; Qwen3-235B 512 and 1536 beside 1024 and 2048), where
# the search timed a faster point than the row (Qwen3-30B-A3B 3072, 4096), and Mixtral-8x7B's
# lowest roofline buckets (512, 1024) were planned but left out for device time.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run1.txt
cp runtime/tables/nvidia_H200.db $OUT/tune.db
for job in deepseek-v3:2048,1024:120 qwen3-235b-a22b:1536,512:100 qwen3-30b-a3b:3072,4096:120; do
  preset=${job%%:*}; rest=${job#*:}; buckets=${rest%%:*}; limit=${rest#*:}
  timeout $limit moetune tune --preset $preset --device cuda --output $OUT/tune.db \
    --buckets $buckets --trials 12 --seed 7 > $OUT/tune-$preset.log 2>&1
  echo "$preset tune exit $?"; grep -E "^M=" -A3 $OUT/tune-$preset.log | grep -o "^M=[0-9]*\|[0-9.]*us vs.*s ("
done
rm -rf $OUT/.tune.db.locks
