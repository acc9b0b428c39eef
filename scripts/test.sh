#!/usr/bin/env bash
# Set up everything and run the whole test suite (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --vllm
set +e
python3 -m pytest -q -rs "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit $rc
