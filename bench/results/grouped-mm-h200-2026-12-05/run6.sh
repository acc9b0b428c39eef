#!/usr/bin/env bash
# The H100 table's second preset: all 18 Qwen3-30B-A3B buckets (vLLM ships no H100 file for
# E=128, N=768: its default config is the rule), tuned into a copy of the shipped H100 table.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run6.txt
cat $OUT/gpu-run6.txt
grep -q H100 $OUT/gpu-run6.txt || { echo "not an H100: no tune"; exit 3; }
cp runtime/tables/nvidia_H100_80GB_HBM3.db $OUT/tune.db
timeout 510 moetune tune --preset qwen3-30b-a3b --device cuda --output $OUT/tune.db \
  --trials 12 --seed 7 > $OUT/tune-qwen3-30b-a3b.log 2>&1
echo "tune exit $?"; grep -E "^M=" $OUT/tune-qwen3-30b-a3b.log | sed -E 's/\{[^}]*\}//' | cut -c1-140
rm -rf $OUT/.tune.db.locks
