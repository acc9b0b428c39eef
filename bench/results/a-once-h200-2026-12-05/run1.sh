#!/usr/bin/env bash
# First H200 run: g2_A_ONCE (GEMM2's activation rows loaded once per program for its tiles) side
# by side with the shipped table's rows at the TP8 shards' prefill buckets (I = 192 and 256),
# then the CUDA tests of the new variants.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
V="g2_A_ONCE=0"
V="$V;g2_A_ONCE=1"
V="$V;g2_A_ONCE=1,g2_BLOCK_SIZE_K=128,g2_N_TILES=4,g2_PERSISTENT=0,g2_BLOCK_SIZE_N=128,g2_num_stages=2"
V="$V;g2_A_ONCE=1,g2_BLOCK_SIZE_K=128,g2_N_TILES=8,g2_PERSISTENT=0,g2_BLOCK_SIZE_N=128,g2_num_stages=3"
V="$V;g2_A_ONCE=1,g2_BLOCK_SIZE_K=128,g2_N_TILES=8,g2_PERSISTENT=0,g2_BLOCK_SIZE_M=128,g2_A_TMA=0,g2_num_warps=8,g2_BLOCK_SIZE_N=128,g2_num_stages=2"
V="$V;g2_A_ONCE=1,g2_BLOCK_SIZE_K=256,g2_N_TILES=8,g2_PERSISTENT=0,g2_BLOCK_SIZE_M=64,g2_A_TMA=0,g2_BLOCK_SIZE_N=128,g2_num_stages=2"
V="$V;g2_A_ONCE=1,g2_BLOCK_SIZE_K=128,g2_N_TILES=4,g2_PERSISTENT=0,g2_BLOCK_SIZE_M=64,g2_A_TMA=0,g2_BLOCK_SIZE_N=256,g2_num_warps=8,g2_num_stages=2"
timeout 330 python3 scripts/bench_param.py --kernel moetune_grouped --commit "$COMMIT" --variants "$V" \
  --cases deepseek-v3:1024,deepseek-v3:2048,deepseek-v3:3072,deepseek-v3:4096,qwen3-235b-a22b:1024,qwen3-235b-a22b:2048,qwen3-235b-a22b:3072,qwen3-235b-a22b:4096 \
  --json $OUT/a_once.jsonl > $OUT/a_once.md 2> $OUT/a_once.err
echo "bench exit $?"; tail -n 30 $OUT/a_once.md; tail -n 3 $OUT/a_once.err
timeout 150 python3 -m pytest -q tests/test_kernels_cuda.py -k "A_ONCE" > $OUT/cuda-a-once.txt 2>&1
tail -n 3 $OUT/cuda-a-once.txt
