#!/usr/bin/env bash
# Tune presets into one table on a GPU machine within a wall-clock budget, against vLLM's tuned
# configs. Each preset runs until the budget is spent; a preset cut short keeps the buckets it
# finished (each is published atomically) and the same command later resumes it
# (--skip-tuned leaves the buckets already tuned against today's rule).
#   scripts/tune_gpu.sh TABLE BUDGET_S VLLM_CONFIGS LOG_DIR PRESET[:OPTS] ...
#   e.g. scripts/tune_gpu.sh h200.db 540 .vllm-configs logs deepseek-v3 "llama-4-maverick:--compile-workers 0"
set -uo pipefail
table=$1 budget=$2 configs=$3 logs=$4; shift 4
export VLLM_TUNED_CONFIG_FOLDER=$(realpath "$configs")
mkdir -p "$logs"
deadline=$(( $(date +%s) + budget ))
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$logs/gpu.txt"
for item in "$@"; do
  name=${item%%:*}; opts=""
  [[ "$item" == *:* ]] && opts=${item#*:}
  left=$(( deadline - $(date +%s) ))
  if (( left < 45 )); then echo "budget spent before $name"; break; fi
  echo "== $name ($opts), ${left}s left"
  # shellcheck disable=SC2086
  timeout --signal=TERM --kill-after=15 "$left" moetune tune --preset "$name" --device cuda \
    --output "$table" --skip-tuned $opts > "$logs/tune-$name.log" 2>&1
  echo "   exit $? after $(( $(date +%s) + left - deadline ))s"; tail -n 3 "$logs/tune-$name.log"
done
