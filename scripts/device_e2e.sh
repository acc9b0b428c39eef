#!/usr/bin/env bash
# On the GPU machine, once scripts/vllm_device_unpack.py has assembled vLLM's offline engine in
# /tmp/vllm-site (docs/vllm.md): one round of scripts/bench_vllm_e2e.py (an off and a lookup
# process) started in the background in a session of its own (setsid: the machine ends a call's
# other processes when it returns), then polled until it ends
# or BUDGET_S is spent. A round outlives the 10-minute limit of a call: a later call polls the
# running one instead of starting another, and a call after it ended starts the next round
# (--resume). Every call packs the report, the raw results and the engines' logs into
# $OUT/e2e.tgz.
#   OUT=... COMMIT=<sha> BUDGET_S=540 bash scripts/device_e2e.sh --preset qwen3-30b-a3b \
#       --profile --gpu-memory-utilization 0.93 [--layers N] [--check-only] ...
set -u
STATE=${STATE:-/tmp/moetune-e2e}
BUDGET_S=${BUDGET_S:-540}
mkdir -p "$STATE"
export PYTHONPATH=/tmp/vllm-site:$HOME/site:${PYTHONPATH:-} VLLM_USE_DEEP_GEMM=0
# vLLM's sampler probes FlashInfer (carried only with --flashinfer); greedy sampling runs in torch.
export VLLM_USE_FLASHINFER_SAMPLER=0
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null || exit 1
deadline=$(( $(date +%s) + BUDGET_S ))
if pgrep -f "bench_vllm_e2e.py" > /dev/null; then
  echo "a round is running: polling it"
else
  setsid nohup python3 scripts/bench_vllm_e2e.py "$@" --rounds 1 --resume --commit "${COMMIT:-unknown}" \
    --json "$STATE/e2e.jsonl" --out "$STATE/e2e.md" >> "$STATE/e2e.out" 2>&1 &
fi
while pgrep -f "bench_vllm_e2e.py" > /dev/null && (( $(date +%s) < deadline )); do sleep 10; done
pgrep -f "bench_vllm_e2e.py" > /dev/null && echo "still running: call again" || tail -3 "$STATE/e2e.out"
grep -hE "moetune: .*(hits|hooked)" "$STATE"/*.log 2>/dev/null | cut -c1-200 | tail -4
tar czf "$OUT/e2e.tgz" -C "$STATE" .
