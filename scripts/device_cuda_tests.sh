#!/usr/bin/env bash
# On the GPU machine: the CUDA kernel and contract tests (4 workers, JUnit record), then doctor and
# lookup on CUDA, with vLLM's tuned configs from .vllm-configs (copy them from the vLLM release the
# rule should follow). Carried: .whl (../shared/device/wheels.sh, then scripts/slim_aiter_wheel.py .whl
# to fit the 64 MiB tree) and .vllm-configs.
# vLLM's own Triton path (the rule's vllm_triton and vllm_triton_tuned) is tested too where vLLM was
# assembled in /tmp/vllm-site on this machine (docs/vllm.md); its tests skip, saying so, elsewhere.
#   COMMIT=$(git rev-parse --short HEAD) bash scripts/device_cuda_tests.sh   (writes to $OUT)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $HOME/site .whl/*.whl && export PYTHONPATH=$HOME/site:${PYTHONPATH:-} && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export VLLM_TUNED_CONFIG_FOLDER=$PWD/.vllm-configs
if [[ -d /tmp/vllm-site/vllm ]]; then export PYTHONPATH=/tmp/vllm-site:$PYTHONPATH VLLM_USE_DEEP_GEMM=0; fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a $OUT/gpu.txt
echo "commit ${COMMIT:-unknown}" | tee -a $OUT/gpu.txt
start=$(date +%s)
timeout 420 python3 -m pytest -q -p no:cacheprovider -n 4 --junitxml=$OUT/cuda-tests.xml tests/test_kernels_cuda.py tests/test_kernel_contract.py tests/test_vllm_triton.py tests/test_vllm_triton_tuned.py > $OUT/cuda-tests.txt 2>&1
echo "pytest exit $? after $(( $(date +%s) - start )) s" | tee -a $OUT/cuda-tests.txt
tail -3 $OUT/cuda-tests.txt
{ moetune doctor --device cuda --preset qwen3-30b-a3b; echo; moetune lookup --device cuda --preset qwen3-30b-a3b --num-tokens 64; echo; moetune lookup --device cuda --preset deepseek-v3 --num-tokens 1; } > $OUT/doctor-lookup.txt 2>&1
echo "cli exit $?"; head -5 $OUT/doctor-lookup.txt
