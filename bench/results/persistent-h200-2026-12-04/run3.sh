#!/usr/bin/env bash
# Third H200 run: the persistent GEMM2 over units of g2_N_TILES tiles side by side at the table's
# rows, its CUDA tests, and a re-tune of DeepSeek-V3 at 2048-4096 into a copy of the shipped table.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run3.txt
timeout 200 python3 scripts/bench_param.py --kernel moetune_grouped --commit "$COMMIT" \
  --variants "g2_PERSISTENT=0;g2_PERSISTENT=2;g2_PERSISTENT=2,g2_N_TILES=1;g2_PERSISTENT=4" \
  --cases deepseek-v3:4096,deepseek-v3:3072,deepseek-v3:2048,deepseek-v3:1024,qwen3-235b-a22b:4096,qwen3-235b-a22b:1024 \
  --json $OUT/units.jsonl > $OUT/units.md 2> $OUT/units.err
tail -n 14 $OUT/units.md
timeout 100 python3 -m pytest -q tests/test_kernels_cuda.py -k "grouped_variants and PERSISTENT" > $OUT/cuda-persistent.txt 2>&1
tail -n 2 $OUT/cuda-persistent.txt
cp runtime/tables/nvidia_H200.db $OUT/tune.db
timeout 230 moetune tune --preset deepseek-v3 --device cuda --output $OUT/tune.db \
  --buckets 2048,3072,4096 --trials 12 > $OUT/tune-deepseek-v3.log 2>&1
echo "tune exit $?"; grep -E "^M=" -A3 $OUT/tune-deepseek-v3.log | grep -o "[0-9.]*us vs.*"
rm -rf $OUT/.tune.db.locks
