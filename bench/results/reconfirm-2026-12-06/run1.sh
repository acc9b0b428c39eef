#!/usr/bin/env bash
# Adopting a shipped table under other versions: `moetune tune --skip-tuned --reconfirm` on a
# copy of the table shipped for this GPU whose runs are marked as timed under torch 2.13 and
# Triton 3.7.1 (vLLM 0.32's pins), so that every row is foreign here and is re-confirmed.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl
export PYTHONPATH=$HOME/site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
case "$(cat $OUT/gpu.txt)" in
  *H200*) table=runtime/tables/nvidia_H200.db ;;
  *H100*) table=runtime/tables/nvidia_H100_80GB_HBM3.db ;;
  *) echo "no shipped table for this GPU"; exit 3 ;;
esac
cp $table $OUT/adopted.db
python3 - $OUT/adopted.db <<'PY'
import json, sqlite3, sys
con = sqlite3.connect(sys.argv[1])
for run_id, env in con.execute("SELECT id, environment FROM tuning_run").fetchall():
    env = {**json.loads(env), "torch": "2.13.0", "triton": "3.7.1"}
    con.execute("UPDATE tuning_run SET environment = ? WHERE id = ?", (json.dumps(env), run_id))
con.commit()
PY
moetune show $OUT/adopted.db --json --device cuda | python3 -c "import json,sys; r=[json.loads(l) for l in sys.stdin]; print(sum(x['served'] for x in r), 'of', len(r), 'rows served before')"
for job in qwen3-30b-a3b:200 mixtral-8x7b:300; do
  preset=${job%%:*}; limit=${job#*:}
  start=$(date +%s)
  timeout $limit moetune tune --preset $preset --device cuda --skip-tuned --reconfirm \
    --output $OUT/adopted.db > $OUT/reconfirm-$preset.log 2>&1
  echo "$preset exit $? after $(( $(date +%s) - start )) s" | tee -a $OUT/reconfirm-$preset.log
  grep -E "^M=" $OUT/reconfirm-$preset.log | sed 's/{.*}//' | cut -c1-200
done
moetune show $OUT/adopted.db --json --device cuda | python3 -c "import json,sys; r=[json.loads(l) for l in sys.stdin]; print(sum(x['served'] for x in r), 'of', len(r), 'rows served after')"
rm -rf $OUT/.adopted.db.locks
