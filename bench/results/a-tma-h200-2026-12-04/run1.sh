#!/usr/bin/env bash
# First H200 run: g2_A_TMA (GEMM2's activation tiles through TMA from the sorted intermediate)
# side by side at the shipped table's rows, alone and on the persistent grid, then its CUDA tests.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
timeout 380 python3 scripts/bench_param.py --kernel moetune_grouped --commit "$COMMIT" \
  --variants "g2_A_TMA=0;g2_A_TMA=1;g2_A_TMA=1,g2_PERSISTENT=2" \
  --cases deepseek-v3:8,deepseek-v3:128,deepseek-v3:1024,deepseek-v3:2048,deepseek-v3:4096,qwen3-235b-a22b:2,qwen3-235b-a22b:128,qwen3-235b-a22b:1024,qwen3-235b-a22b:4096,qwen3-30b-a3b:256,qwen3-30b-a3b:4096,llama-4-maverick:4096 \
  --json $OUT/a_tma.jsonl > $OUT/a_tma.md 2> $OUT/a_tma.err
tail -n 20 $OUT/a_tma.md; tail -n 3 $OUT/a_tma.err
timeout 150 python3 -m pytest -q tests/test_kernels_cuda.py -k "A_TMA or activation_quant" > $OUT/cuda-a-tma.txt 2>&1
tail -n 3 $OUT/cuda-a-tma.txt
