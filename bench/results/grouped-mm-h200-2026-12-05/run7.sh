#!/usr/bin/env bash
# The H100 table's third preset: all 18 Qwen3-235B-A22B TP8 buckets (vLLM ships its H100 file
# E=128, N=192: that file is the rule), tuned into a copy of the shipped H100 table; 330 s at most.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run7.txt
cat $OUT/gpu-run7.txt
grep -q H100 $OUT/gpu-run7.txt || { echo "not an H100: no tune"; exit 3; }
cp runtime/tables/nvidia_H100_80GB_HBM3.db $OUT/tune.db
timeout 330 moetune tune --preset qwen3-235b-a22b --device cuda --output $OUT/tune.db \
  --trials 12 --seed 7 > $OUT/tune-qwen3-235b-a22b.log 2>&1
echo "tune exit $?"; grep -E "^M=" $OUT/tune-qwen3-235b-a22b.log | sed -E 's/\{[^}]*\}//' | cut -c1-140
rm -rf $OUT/.tune.db.locks
