#!/usr/bin/env bash
# Third H200 run: moetune_grouped's CUDA tests (every variant, g2_A_TMA's among them) and the
# activation quantization's, then a re-tune from another sampler seed of Qwen3-30B-A3B at
# 2048-4096 and Mixtral-8x7B at 512-1024 tokens (the search reuses every earlier measurement
# in the table, so a new seed explores new points) into a copy of the table as merged so far.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
timeout 270 python3 -m pytest -q tests/test_kernels_cuda.py -k "grouped or activation_quant" > $OUT/cuda-grouped.txt 2>&1
tail -n 2 $OUT/cuda-grouped.txt
cp runtime/tables/nvidia_H200.db $OUT/tune.db
for job in qwen3-30b-a3b:2048,3072,4096 mixtral-8x7b:512,1024; do
  preset=${job%%:*}
  timeout 150 moetune tune --preset $preset --device cuda --output $OUT/tune.db \
    --buckets ${job#*:} --trials 24 --seed 5 > $OUT/tune-$preset.log 2>&1
  echo "$preset tune exit $?"; grep -E "^M=" -A3 $OUT/tune-$preset.log | grep -o "[0-9.]*us vs.*"
done
rm -rf $OUT/.tune.db.locks
