#!/usr/bin/env bash
# `moetune adopt` as a user runs it, on a GPU whose shipped table (in this copy of the
# checkout) has its runs marked as timed under torch 2.13 and Triton 3.7.1, as in run1.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs MOETUNE_HOME=$OUT/home
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $OUT/gpu-run3.txt
for table in runtime/tables/*.db; do
python3 - $table <<'PY'
import json, sqlite3, sys
con = sqlite3.connect(sys.argv[1])
for run_id, env in con.execute("SELECT id, environment FROM tuning_run").fetchall():
    env = {**json.loads(env), "torch": "2.13.0", "triton": "3.7.1"}
    con.execute("UPDATE tuning_run SET environment = ? WHERE id = ?", (json.dumps(env), run_id))
con.commit()
PY
done
moetune doctor --preset mixtral-8x7b | grep "^table:" | tee $OUT/doctor-before.txt
start=$(date +%s)
timeout 480 moetune adopt > $OUT/adopt-run3.log 2>&1
echo "adopt exit $? after $(( $(date +%s) - start )) s" | tee -a $OUT/adopt-run3.log
grep -E "^M=" $OUT/adopt-run3.log | sed 's/{.*}//' | cut -c1-160 | tail -8
tail -1 $OUT/adopt-run3.log
moetune doctor --preset mixtral-8x7b | grep "^table:" | tee $OUT/doctor-after.txt
rm -rf $OUT/home/tables/.*.locks
