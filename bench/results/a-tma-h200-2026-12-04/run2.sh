#!/usr/bin/env bash
# Second H200 run: re-tune, with g2_A_TMA among the options, the buckets where it was faster
# side by side (DeepSeek-V3 and Qwen3-235B at 2048-4096 tokens) into a copy of the shipped table.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
cp runtime/tables/nvidia_H200.db $OUT/tune.db
for preset in deepseek-v3 qwen3-235b-a22b; do
  timeout 270 moetune tune --preset $preset --device cuda --output $OUT/tune.db \
    --buckets 2048,3072,4096 --trials 12 > $OUT/tune-$preset.log 2>&1
  echo "$preset tune exit $?"; grep -E "^M=" -A3 $OUT/tune-$preset.log | grep -o "[0-9.]*us vs.*"
done
rm -rf $OUT/.tune.db.locks
