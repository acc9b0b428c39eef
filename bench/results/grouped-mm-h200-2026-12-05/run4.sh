#!/usr/bin/env bash
# Fallback where no H200 starts: a table for the GPU this runs on, all 18 Mixtral-8x7B buckets
# (a partial table would serve its nearest tuned bucket to every num_tokens), vLLM's configs as
# the rule.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run4.txt
cat $OUT/gpu-run4.txt
timeout 520 moetune tune --preset mixtral-8x7b --device cuda --output $OUT/tune.db \
  --trials 12 --seed 7 > $OUT/tune-mixtral-8x7b.log 2>&1
echo "tune exit $?"; grep -E "^M=" $OUT/tune-mixtral-8x7b.log | cut -c1-120
rm -rf $OUT/.tune.db.locks
