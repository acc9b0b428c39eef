#!/usr/bin/env bash
# First H200 run of g2_PERSISTENT: variants side by side at the table's rows, then the CUDA
# tests of the new variants. Run from the repository root on the GPU machine.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
commit=$(git rev-parse --short HEAD 2>/dev/null || echo "${COMMIT:-unknown}")
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
timeout 400 python3 scripts/bench_param.py --kernel moetune_grouped --commit "$commit" \
  --variants "g2_PERSISTENT=0;g2_PERSISTENT=1,g2_N_TILES=1;g2_PERSISTENT=2,g2_N_TILES=1;g2_PERSISTENT=4,g2_N_TILES=1" \
  --cases deepseek-v3:4096,qwen3-235b-a22b:4096,deepseek-v3:2048,qwen3-235b-a22b:2048,qwen3-30b-a3b:4096,deepseek-v3:1024,qwen3-235b-a22b:1024,qwen3-30b-a3b:2048,llama-4-maverick:4096,deepseek-v3:3072,qwen3-235b-a22b:3072,deepseek-v3:512 \
  --json $OUT/persistent.jsonl > $OUT/persistent.md 2> $OUT/persistent.err
tail -n 30 $OUT/persistent.md
timeout 150 python3 -m pytest -q -x tests/test_kernels_cuda.py -k "grouped_variants and PERSISTENT" > $OUT/cuda-persistent.txt 2>&1
tail -n 5 $OUT/cuda-persistent.txt
