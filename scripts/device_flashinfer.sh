#!/usr/bin/env bash
# On the GPU machine (pack here: python scripts/vllm_device_pack.py 0.34.0 --flashinfer --out
# .vllm-pack, then one part per call there, each through scripts/vllm_device_unpack.py PART
# --early-site $FI_SITE): FlashInfer's import and the JIT build of its CUTLASS fused MoE (or the
# load of a kept one, AOT=), its first and second calls (probe) and the CUDA tests of
# flashinfer_cutlass (tests), which need only the pack's first parts (FlashInfer imports from
# $FI_SITE alone) and so run from the first calls, then, once vLLM is "ready", its time against
# vLLM's Triton pick and the shipped table's winner (PRESETS, BUCKETS) from decode to prefill
# (bench). The build (248 compile units for sm_90) may outlast a 10-minute call, so probe
# starts it in the background in a session of its own (setsid: the machine ends a call's other
# processes when it returns) at nice 5 (GPU tests run beside it come first), and each
# call polls it until BUDGET_S is spent; the steps after it wait for a call in which it has ended
# (they would build it themselves otherwise), and a step that no longer fits in the call's 10
# minutes waits for the next one. State lives in $STATE, the JIT's objects and module in
# ~/.cache/flashinfer (ninja keeps what it built if the build is started again), both kept while the
# machine is; a call skips finished steps, the benchmark resumes from its JSON, and every call
# copies what there is into $OUT.
#   OUT=... COMMIT=<sha> [AOT=DIR | HANDOFF=DIR | PARTIAL=bf16,fp16,fp8-block] [PRESETS=.. BUCKETS=..
#     PROBE_PRESETS=.. TESTS_K=..] \
#     bash scripts/device_flashinfer.sh [probe] [tests] [bench]
set -u
SITE=${SITE:-/tmp/vllm-site}
FI_SITE=${FI_SITE:-/tmp/flashinfer-site}  # first on the path: the FlashInfer the build compiled
STATE=${STATE:-/tmp/moetune-flashinfer}
BUDGET_S=${BUDGET_S:-540}
#: Block fp8 (DeepSeek-V3 TP8) and bf16 (Mixtral, Qwen3-30B: the worst buckets of the H100 table
#: are there, memory-bound at 512-2048 tokens), at sizes from decode to the largest prefill.
PRESETS=${PRESETS:-deepseek-v3,mixtral-8x7b,qwen3-30b-a3b}
BUCKETS=${BUCKETS:-1,2,16,128,512,1024,2048,3072,4096}
#: The probe's presets and the tests' -k: narrower where the module was built for fewer dtypes
#: (scripts/flashinfer_partial_build.py; a dtype it left out aborts the process that calls it).
PROBE_PRESETS=${PROBE_PRESETS:-deepseek-v3,qwen3-30b-a3b}
TESTS_K=${TESTS_K:-flashinfer}
mkdir -p "$STATE"
export PYTHONPATH=$FI_SITE:$SITE:$HOME/site:${PYTHONPATH:-}
export PATH=$PATH:$FI_SITE/bin  # FlashInfer's JIT runs ninja; the carried one where the image has none
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null || exit 1

# What comes back is a few files: the state as one tar, and the built module's chunks.
save() {
  tar -czf "$OUT/flashinfer.tgz" -C "$STATE" --exclude=aot --exclude='*.done' . 2> /dev/null
  cp "$STATE"/aot/* "$OUT"/ 2> /dev/null
}

# The built module comes back as chunks (scripts/flashinfer_module.sh keep); AOT=a folder of
# them (from this script or scripts/flashinfer_aot_build.sh) puts it where FlashInfer loads it
# instead of building.
keep_module() { [ -n "${AOT:-}" ] || bash scripts/flashinfer_module.sh keep "$STATE/aot"; }
# HANDOFF=a folder of scripts/flashinfer_handoff.sh pack: the build begun on a machine without a
# GPU, finished here on all cores (the objects come from $(handoff_ws)), then kept as above.
handoff_ws() { [ -n "${HANDOFF:-}" ] && sed -n 's/^ws=//p' "$HANDOFF/paths"; }
restore_module() {
  [ -n "${AOT:-}" ] && bash scripts/flashinfer_module.sh restore "$AOT" "$FI_SITE"
}

# PARTIAL=bf16,fp16,fp8-block: only those dtypes' units (scripts/flashinfer_partial_build.py, 44 of 248
# for these three: minutes on this host's cores), in a workspace of their own, kept as above and put
# where FlashInfer loads it, so the probe loads it instead of building the whole module.
partial_build() {  # STATE DTYPES SITE
  local ws=/tmp/flashinfer-partial dtypes
  dtypes=$(echo "$2" | sed 's/\([^,]*\)/--dtypes \1/g; s/,/ /g')
  # shellcheck disable=SC2086
  nice -n 5 python3 scripts/flashinfer_partial_build.py $dtypes --workspace "$ws" --jobs "$(nproc)" \
    >> "$1/build.err" 2>&1 \
    && FLASHINFER_WORKSPACE_BASE=$ws bash scripts/flashinfer_module.sh keep "$1/aot" \
    && cp "$(find "$ws/" -name partial.json | head -1)" "$1/aot/" \
    && bash scripts/flashinfer_module.sh restore "$1/aot" "$3"
}
export -f partial_build

# The background build: 0 once build.json is there, 1 while it runs, 2 if it failed.
poll_build() {
  [ -e "$STATE/build.json" ] && { keep_module; return 0; }
  [ -e "$FI_SITE/.ready" ] || { echo "no FlashInfer in $FI_SITE: unpack its parts there"; return 2; }
  restore_module
  local pid
  pid=$(cat "$STATE/build.pid" 2> /dev/null)
  if [ -n "$pid" ] && kill -0 "$pid" 2> /dev/null; then
    echo "the build is running (since $(cat "$STATE/build.started")): polling it"
  else
    date -u +%H:%M:%S > "$STATE/build.started"
    setsid nohup bash -c '{ [ -z "$1" ] || bash scripts/flashinfer_handoff.sh finish "$1" "$2" \
      "$0/aot" 2>> "$0/build.err"; } && { [ -z "$3" ] || partial_build "$0" "$3" "$2"; } \
      && nice -n 5 python3 scripts/probe_flashinfer.py --build \
      > "$0/build.part" 2>> "$0/build.err" && mv "$0/build.part" "$0/build.json"' \
      "$STATE" "${HANDOFF:-}" "$FI_SITE" "${PARTIAL:-}" > /dev/null 2>&1 &
    pid=$!
    echo "$pid" > "$STATE/build.pid"
    echo "the build started in the background"
  fi
  while kill -0 "$pid" 2> /dev/null && (( $(date +%s) < start + BUDGET_S )); do sleep 10; done
  [ -e "$STATE/build.json" ] && { keep_module; return 0; }
  if kill -0 "$pid" 2> /dev/null; then
    echo "still building ($(find "$HOME"/.cache/flashinfer "$(handoff_ws)" \
      -path '*cached_ops/fused_moe_*' -name '*.o' 2> /dev/null | wc -l) of 248 objects): call again"
    return 1
  fi
  echo "the build failed:"; tail -20 "$STATE/build.err"
  return 2
}

# Whether a step of up to $1 seconds still fits in this call (10 minutes, the copy into $OUT last).
room() { (( $(date +%s) - start + $1 <= 590 )); }

steps=${*:-probe tests bench}
for step in $steps; do
  [ -e "$STATE/$step.done" ] && { echo "$step: done before"; continue; }
  case $step in
    probe)
      poll_build; built=$?
      (( built == 2 )) && { save; exit 1; }
      (( built == 1 )) && break
      cat "$STATE/build.json"
      room 300 || { echo "probe: the calls in the next call"; break; }
      timeout 300 python3 scripts/probe_flashinfer.py --presets "$PROBE_PRESETS" > "$STATE/probe.json" 2> "$STATE/probe.err" &&
        touch "$STATE/probe.done"
      cat "$STATE/probe.json"; tail -5 "$STATE/probe.err" ;;
    tests)
      [ -e "$STATE/build.json" ] || { echo "tests: run probe first (the build)"; break; }
      room 500 || { echo "tests: in the next call"; break; }
      timeout 500 python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$STATE/tests.xml" \
        tests/test_flashinfer_cutlass.py tests/test_kernel_contract.py tests/test_kernels_cuda.py \
        -k "$TESTS_K" > "$STATE/tests.txt" 2>&1 && touch "$STATE/tests.done"
      tail -15 "$STATE/tests.txt" ;;
    bench)
      [ -e "$STATE/build.json" ] || { echo "bench: run probe first (the build)"; break; }
      [ -e "$SITE/.ready" ] || { echo "bench: once vLLM is ready (its pick is the baseline)"; break; }
      room 540 || { echo "bench: in the next call"; break; }
      timeout 540 python3 scripts/bench_vllm_baseline.py --presets "$PRESETS" --buckets "$BUCKETS" \
        --also flashinfer_cutlass --rounds 3 --budget-s 420 --commit "${COMMIT:-unknown}" \
        --json "$STATE/bench.jsonl" > "$STATE/bench.md" 2> "$STATE/bench.err"
      grep -q "not measured: budget spent" "$STATE/bench.md" || touch "$STATE/bench.done"
      tail -30 "$STATE/bench.md"; tail -3 "$STATE/bench.err" ;;
    *) echo "unknown step $step (probe, tests, bench)"; exit 2 ;;
  esac
done
save
