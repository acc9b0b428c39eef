#!/usr/bin/env bash
# On the GPU machine, once vllm_device_unpack.py has assembled vLLM there (docs/vllm.md): the rule
# kernel's CUDA test, then every bucket of the shipped table for this GPU re-confirmed against
# the rule here, vLLM's own path (`tune --skip-tuned --reconfirm`: no search; a winner that no
# longer beats vLLM's pick gives the bucket back to it). Resumable: the table is kept in /tmp
# while the machine is, and a second call goes on with the buckets the first left. Writes the
# table, the logs and `show` of the result to $OUT.
#   COMMIT=$(git rev-parse --short HEAD) BUDGET_S=420 bash scripts/device_reconfirm.sh
set -u
export PYTHONPATH=/tmp/vllm-site:$HOME/site VLLM_USE_DEEP_GEMM=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
echo "commit ${COMMIT:-unknown}" | tee -a $OUT/gpu.txt
name=$(python3 -c "from moetune.runtime.platform import detect_sku; from moetune.runtime.dispatcher import shipped_table; print(shipped_table(detect_sku('cuda')))")
table=/tmp/reconfirm-$(basename $name)
if [ ! -f $table ]; then
  cp $name $table
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_vllm_triton.py > $OUT/vllm-triton-tests.txt 2>&1
  tail -1 $OUT/vllm-triton-tests.txt
fi
start=$(date +%s)
timeout ${BUDGET_S:-420} moetune tune --device cuda --skip-tuned --reconfirm --output $table >> /tmp/reconfirm.log 2>&1
echo "tune exit $? after $(( $(date +%s) - start )) s" | tee -a /tmp/reconfirm.log
cp /tmp/reconfirm.log $OUT/reconfirm.log
grep -E "^M=" /tmp/reconfirm.log | sed 's/{.*}//' | cut -c1-160 | tail -20
moetune show $table --device cuda > $OUT/show.txt 2>&1
moetune show $table --json --device cuda > $OUT/show.jsonl 2>&1
python3 -c "import json,sys; r=[json.loads(l) for l in open('$OUT/show.jsonl')]; print(sum(bool(x.get('served')) for x in r), 'of', len(r), 'rows served')"
rm -rf $table.locks; cp $table $OUT/
