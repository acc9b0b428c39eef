#!/usr/bin/env bash
# After run1 on the same machine: every other bucket of the table run1 left (run1's
# adopted.db, carried as adopted-run1.db; not kept: adopted.db is run2's output), with no
# shape given: `moetune tune --skip-tuned --reconfirm` takes the table's own buckets for this
# GPU and skips those run1 re-confirmed.
set -u
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $OUT/gpu-run2.txt
cp bench/results/reconfirm-2026-12-06/adopted-run1.db $OUT/adopted.db
start=$(date +%s)
timeout 420 moetune tune --device cuda --skip-tuned --reconfirm --output $OUT/adopted.db \
  > $OUT/reconfirm-rest-run2.log 2>&1
echo "exit $? after $(( $(date +%s) - start )) s" | tee -a $OUT/reconfirm-rest-run2.log
grep -E "^M=" $OUT/reconfirm-rest-run2.log | sed 's/{.*}//' | cut -c1-200 | tail -60
moetune show $OUT/adopted.db --json --device cuda | python3 -c "import json,sys; r=[json.loads(l) for l in sys.stdin]; print(sum(x['served'] for x in r), 'of', len(r), 'rows served after')"
rm -rf $OUT/.adopted.db.locks
