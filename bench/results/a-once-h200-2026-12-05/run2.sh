#!/usr/bin/env bash
# Second H200 run: re-tunes from another sampler seed (5), each bucket's search also measuring
# the table's winners at the neighbouring num_tokens (the tuner's starts), into a copy of the
# shipped table: the goal presets' buckets furthest from the roofline that moetune serves.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run2.txt
cp runtime/tables/nvidia_H200.db $OUT/tune.db
for job in deepseek-v3:1024,2048,3072,4096:165 qwen3-30b-a3b:1536,2048,3072,4096:185 \
           llama-4-maverick:1,2,4,8,16:110; do
  preset=${job%%:*}; rest=${job#*:}; buckets=${rest%%:*}; limit=${rest#*:}
  timeout $limit moetune tune --preset $preset --device cuda --output $OUT/tune.db \
    --buckets $buckets --trials 12 --seed 5 > $OUT/tune-$preset.log 2>&1
  echo "$preset tune exit $?"; grep -E "^M=" -A3 $OUT/tune-$preset.log | grep -o "^M=[0-9]*\|[0-9.]*us vs.*s ("
done
rm -rf $OUT/.tune.db.locks
