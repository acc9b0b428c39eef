#!/usr/bin/env bash
# Fourth H200 run: g1_FP8_OUT (GEMM1's epilogue writes GEMM2's block-fp8 input) side by side at
# DeepSeek-V3's table rows, against the same 128-column tiles with the separate quantization
# launch, at the table's warps and at 8; moetune_grouped's CUDA tests; then a re-tune of
# DeepSeek-V3 at 8-2048 tokens with it among the options into a copy of the shipped table.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu-run4.txt
timeout 150 python3 scripts/bench_param.py --kernel moetune_grouped --commit "$COMMIT" \
  --variants "g1_FP8_OUT=0;g1_BLOCK_SIZE_N=128,g1_FP8_OUT=0;g1_BLOCK_SIZE_N=128,g1_FP8_OUT=1;g1_BLOCK_SIZE_N=128,g1_num_warps=8,g1_FP8_OUT=0;g1_BLOCK_SIZE_N=128,g1_num_warps=8,g1_FP8_OUT=1" \
  --cases deepseek-v3:8,deepseek-v3:64,deepseek-v3:128,deepseek-v3:512,deepseek-v3:1024,deepseek-v3:2048,deepseek-v3:4096 \
  --json $OUT/fp8_out.jsonl > $OUT/fp8_out.md 2> $OUT/fp8_out.err
tail -n 14 $OUT/fp8_out.md; tail -n 3 $OUT/fp8_out.err
timeout 280 python3 -m pytest -q tests/test_kernels_cuda.py -k "grouped or activation_quant" > $OUT/cuda-grouped.txt 2>&1
tail -n 2 $OUT/cuda-grouped.txt
cp runtime/tables/nvidia_H200.db $OUT/tune.db
timeout 120 moetune tune --preset deepseek-v3 --device cuda --output $OUT/tune.db \
  --buckets 8,64,512,2048 --trials 12 --seed 3 > $OUT/tune-deepseek-v3.log 2>&1
echo "tune exit $?"; grep -E "^M=" -A3 $OUT/tune-deepseek-v3.log | grep -o "[0-9.]*us vs.*"
rm -rf $OUT/.tune.db.locks
