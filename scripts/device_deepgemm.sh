#!/usr/bin/env bash
# On the GPU machine, once scripts/vllm_device_unpack.py has printed "ready: vLLM 0.34.0 (MoE path)
# and DeepGEMM" (pack here: python scripts/vllm_device_pack.py 0.34.0 --deepgemm --out .vllm-pack,
# then one part per call there): DeepGEMM's load and first-call JIT time (probe), the CUDA tests of
# vllm_deepgemm (tests), and its time against vLLM's Triton pick and the shipped table's winner at
# DeepSeek-V3 TP8's block-fp8 buckets (bench). State lives in $STATE on the machine, so a call after
# the 10-minute limit skips finished steps and the benchmark resumes from its JSON (DeepGEMM's JIT
# cache stays there too); every call copies what there is into $OUT.
#   OUT=... COMMIT=<sha> bash scripts/device_deepgemm.sh [probe] [tests] [bench]   (default: all)
set -u
SITE=${SITE:-/tmp/vllm-site}
STATE=${STATE:-/tmp/moetune-deepgemm}
BUCKETS=${BUCKETS:-1,2,4,8,16,24,32,48,64,96,128,256,512,1024,1536,2048,3072,4096}
mkdir -p "$STATE"
export PYTHONPATH=$SITE:$HOME/site:${PYTHONPATH:-}
unset VLLM_USE_DEEP_GEMM VLLM_MOE_USE_DEEP_GEMM VLLM_USE_DEEP_GEMM_E8M0  # vLLM's defaults
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null || exit 1
steps=${*:-probe tests bench}
for step in $steps; do
  [ -e "$STATE/$step.done" ] && { echo "$step: done before"; continue; }
  case $step in
    probe)  # twice: the second call's first_call_s shows the JIT cache
      timeout 400 python3 scripts/probe_deepgemm.py > "$STATE/probe.json" 2> "$STATE/probe.err" &&
        timeout 150 python3 scripts/probe_deepgemm.py > "$STATE/probe-cached.json" 2>> "$STATE/probe.err" &&
        touch "$STATE/probe.done"
      cat "$STATE"/probe*.json; tail -5 "$STATE/probe.err" ;;
    tests)
      timeout 500 python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$STATE/tests.xml" \
        tests/test_vllm_deepgemm.py tests/test_kernel_contract.py tests/test_kernels_cuda.py \
        -k deepgemm > "$STATE/tests.txt" 2>&1 && touch "$STATE/tests.done"
      tail -15 "$STATE/tests.txt" ;;
    bench)
      timeout 540 python3 scripts/bench_vllm_baseline.py --presets deepseek-v3 --buckets "$BUCKETS" \
        --also vllm_deepgemm --rounds 3 --budget-s 420 --commit "${COMMIT:-unknown}" \
        --json "$STATE/bench.jsonl" > "$STATE/bench.md" 2> "$STATE/bench.err"
      grep -q "not measured: budget spent" "$STATE/bench.md" || touch "$STATE/bench.done"
      tail -30 "$STATE/bench.md"; tail -3 "$STATE/bench.err" ;;
    *) echo "unknown step $step (probe, tests, bench)"; exit 2 ;;
  esac
done
cp -r "$STATE"/. "$OUT"/ 2> /dev/null
find "$OUT" -name '*.done' -delete
