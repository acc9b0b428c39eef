"""The control of ``scripts/bench_vllm_e2e.py --control-block-k``: the config file it writes is the
one vLLM's own lookup reads for the model's experts on that device, and it is vLLM's default
config at every size but for the K tile (its sums in another order, nothing else changed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_vllm_e2e as e2e  # noqa: E402

fused_moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe",
                                reason="needs vLLM")
DEVICE = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("preset,experts,n", [("qwen3-30b-a3b", 128, 768),
                                              ("mixtral-8x7b", 8, 14336)])
def test_vllm_reads_the_control_file_as_its_config(preset, experts, n, tmp_path, monkeypatch):
    from vllm.platforms import current_platform

    config = e2e.PRESETS[preset][0]
    e2e.write_control_configs(tmp_path, config, 32, DEVICE)
    monkeypatch.setattr(type(current_platform), "get_device_name",
                        classmethod(lambda cls, device_id=0: DEVICE))
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    fused_moe.get_moe_configs.cache_clear()
    try:
        configs = fused_moe.get_moe_configs(experts, n, None)
    finally:
        fused_moe.get_moe_configs.cache_clear()
    assert configs is not None and sorted(configs) == list(e2e.CONTROL_SIZES)
    for m, entry in configs.items():
        default = fused_moe.get_default_config(m, experts, n, config["hidden_size"],
                                               config["num_experts_per_tok"], None, None)
        default.pop("SPLIT_K", None)  # the kernel's launcher sets it; tuned files leave it out
        assert default["BLOCK_SIZE_K"] != 32
        assert entry == default | {"BLOCK_SIZE_K": 32}, m
