#!/usr/bin/env bash
# Fifth H200 run: a re-tune from another sampler seed of DeepSeek-V3 at 1536-4096 and Qwen3-235B
# at 512-1536 tokens into a copy of the table as merged so far.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
cp runtime/tables/nvidia_H200.db $OUT/tune.db
for job in deepseek-v3:1536,3072,4096 qwen3-235b-a22b:512,1024,1536; do
  preset=${job%%:*}
  timeout 110 moetune tune --preset $preset --device cuda --output $OUT/tune.db \
    --buckets ${job#*:} --trials 12 --seed 3 > $OUT/tune-$preset.log 2>&1
  echo "$preset tune exit $?"; grep -E "^M=" -A3 $OUT/tune-$preset.log | grep -o "[0-9.]*us vs.*"
done
rm -rf $OUT/.tune.db.locks
