#!/usr/bin/env bash
# On the GPU machine, once vLLM is assembled in /tmp/vllm-site (docs/vllm.md): the kernel families
# added beyond the shipped tables, measured where those tables are furthest from the roofline.
#   tests   the families' CUDA tests (vllm_triton_tuned, moetune_decode_one, slots routed nowhere)
#   decode  scripts/bench_decode.py at 1-8 tokens: moetune_decode_one against moetune_decode and
#           vLLM's pick, CUDA-graph timing
#   tune    the worst buckets of the shipped table for this GPU searched again with every family
#           in a copy of that table (the search knows its trials and climbs from its winner, so
#           a bucket keeps a winner at least as fast unless a new family beats it; every winner
#           confirmed against vLLM's pick here), resumable bucket by bucket; the roofline of the
#           shipped table and of the copy
# State lives in $STATE on the machine: a call after the 10-minute limit skips finished steps and
# `tune` goes on with the buckets it has not finished. Every call packs what there is into
# $OUT/families.tgz (what comes back from the machine is a few files).
#   OUT=... COMMIT=<sha> bash scripts/device_families.sh [tests] [decode] [tune]   (default: all)
# (DEVICE=cpu SHIPPED=T WORST="tiny:1,16" runs the `tune` step on the CPU: a check of the step.)
set -u
DEVICE=${DEVICE:-cuda}
SITE=${SITE:-/tmp/vllm-site}
STATE=${STATE:-/tmp/moetune-families}
BUDGET_S=${BUDGET_S:-540}
#: Per preset, the buckets under 0.65 of the roofline in the H100 table of 2026-12-07
#: (bench/results/roofline-h100-2026-12-07.md).
WORST=${WORST:-"mixtral-8x7b:512,1024,1536,2048 qwen3-30b-a3b:1,3072,4096 deepseek-v3:1,2,3072,4096 llama-4-maverick:1,2"}
mkdir -p "$STATE"
export PYTHONPATH=$SITE:$HOME/site:${PYTHONPATH:-} VLLM_USE_DEEP_GEMM=0
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null || exit 1
deadline=$(( $(date +%s) + BUDGET_S ))
shipped=${SHIPPED:-$(python3 -c "from moetune.runtime.platform import detect_sku; from moetune.runtime.dispatcher import shipped_table; print(shipped_table(detect_sku('cuda')))")}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$STATE/gpu.txt" 2>&1
echo "commit ${COMMIT:-unknown}, table $shipped" >> "$STATE/gpu.txt"
steps=${*:-tests decode tune}
for step in $steps; do
  [ -e "$STATE/$step.done" ] && { echo "$step: done before"; continue; }
  left=$(( deadline - $(date +%s) ))
  (( left < 60 )) && { echo "budget spent before $step"; break; }
  case $step in
    tests)
      timeout "$left" python3 -m pytest -q -rs -p no:cacheprovider \
        tests/test_kernels_cuda.py tests/test_kernel_contract.py tests/test_vllm_triton_tuned.py tests/test_vllm_versions.py \
        -k "one_launch or moetune_decode_one or vllm_triton_tuned or unrouted or graph_safe or align or padded" \
        > "$STATE/tests.txt" 2>&1 && touch "$STATE/tests.done"
      tail -3 "$STATE/tests.txt" ;;
    decode)
      timeout "$left" python3 scripts/bench_decode.py --tokens 1,2,4,8 \
        --budget-s $(( left - 60 )) --commit "${COMMIT:-unknown}" --json "$STATE/decode.jsonl" \
        > "$STATE/decode.md" 2> "$STATE/decode.err" && touch "$STATE/decode.done"
      tail -20 "$STATE/decode.md" ;;
    tune)
      tuned="$STATE/tuned.db"
      [ -e "$tuned" ] || cp "$shipped" "$tuned"
      for item in $WORST; do
        preset=${item%%:*}
        todo=$(for m in $(echo "${item#*:}" | tr , " "); do [ -e "$STATE/tuned-$preset-$m" ] || echo "$m"; done | paste -sd,)
        [ -z "$todo" ] && continue
        left=$(( deadline - $(date +%s) ))
        (( left < 60 )) && { echo "budget spent before $preset at $todo"; break; }
        echo "== $preset at $todo tokens, ${left}s left"
        timeout --signal=TERM --kill-after=15 "$left" moetune tune --device "$DEVICE" \
          --preset "$preset" --buckets "$todo" --output "$tuned" > "$STATE/tune.part" 2>&1
        echo "   exit $?"; cat "$STATE/tune.part" >> "$STATE/tune.log"
        for m in $(grep -oE "^M=[0-9]+" "$STATE/tune.part" | cut -c3-); do
          touch "$STATE/tuned-$preset-$m"
        done
        grep -E "^M=" "$STATE/tune.part" | sed 's/{.*}//' | cut -c1-150
      done
      if (( $(date +%s) < deadline - 30 )); then
        python3 scripts/bench_roofline.py "$shipped" > "$STATE/roofline-before.md" 2>&1
        python3 scripts/bench_roofline.py "$tuned" > "$STATE/roofline-after.md" 2>&1
        moetune show "$tuned" --device "$DEVICE" > "$STATE/tuned-show.txt" 2>&1
        tail -8 "$STATE/roofline-after.md" && touch "$STATE/tune.done"
      fi ;;
    *) echo "unknown step $step (tests, decode, tune)"; exit 2 ;;
  esac
done
rm -rf "$STATE"/*.locks
tar czf "$OUT/families.tgz" -C "$STATE" .
