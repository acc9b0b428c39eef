#!/usr/bin/env bash
# Third H200 run: as the second (sampler seed 5, each search also measuring the table's winners
# at the neighbouring num_tokens), at Qwen3-235B-A22B 1024-4096, whose 2048 row uses smaller tiles
# than its neighbours, and at DeepSeek-V3 1536.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run3.txt
cp runtime/tables/nvidia_H200.db $OUT/tune.db
for job in qwen3-235b-a22b:2048,3072,4096,1024,1536:230 deepseek-v3:1536:70; do
  preset=${job%%:*}; rest=${job#*:}; buckets=${rest%%:*}; limit=${rest#*:}
  timeout $limit moetune tune --preset $preset --device cuda --output $OUT/tune.db \
    --buckets $buckets --trials 12 --seed 5 > $OUT/tune-$preset.log 2>&1
  echo "$preset tune exit $?"; grep -E "^M=" -A3 $OUT/tune-$preset.log | grep -o "^M=[0-9]*\|[0-9.]*us vs.*s ("
done
rm -rf $OUT/.tune.db.locks
# Where the time goes on both sides of the 1536 -> 2048 step, with the shipped table's winners.
python3 scripts/profile_moe.py --commit $COMMIT \
  --cases qwen3-235b-a22b:1536,qwen3-235b-a22b:2048,qwen3-30b-a3b:1536,qwen3-30b-a3b:2048 \
  > $OUT/profile-step.md 2> $OUT/profile-step.err
echo "profile exit $?"
