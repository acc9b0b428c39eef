#!/usr/bin/env bash
# The H100 table's fp8 presets: all 18 buckets of PRESET (deepseek-v3 or llama-4-maverick), tuned
# into TABLE (default: a copy of the shipped H100 table) with every kernel; vLLM's configs folder
# is the rule (it ships no H100 file for either shape, so the rule is vLLM's default config).
#   PRESET=deepseek-v3 COMMIT=<sha> bash run1.sh      (540 s at most)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-$PRESET.txt
cat $OUT/gpu-$PRESET.txt; echo "commit $COMMIT" | tee -a $OUT/gpu-$PRESET.txt
grep -q H100 $OUT/gpu-$PRESET.txt || { echo "not an H100: no tune"; exit 3; }
cp ${TABLE:-runtime/tables/nvidia_H100_80GB_HBM3.db} $OUT/tune.db
timeout 540 moetune tune --preset $PRESET --device cuda --output $OUT/tune.db \
  --trials 12 --seed 7 > $OUT/tune-$PRESET.log 2>&1
echo "tune exit $?"; grep -E "^M=" $OUT/tune-$PRESET.log | sed -E 's/\{[^}]*\}//' | cut -c1-140
rm -rf $OUT/.tune.db.locks
