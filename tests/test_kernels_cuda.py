"""The CUDA kernels against the float32 reference on an NVIDIA GPU, for every quant scheme each one
declares, at decode, prefill and odd shapes; and vLLM's default configs against the declared space.

Tolerances are relative Frobenius errors, chosen from what each format rounds (the reference sees
the same quantized weights and inputs, so only the kernel's own roundings count):
- float32: Triton's dots take TF32 inputs (10-bit mantissa, ~5e-4 per product): 5e-3.
- float16: the intermediate, activation and per-expert outputs are rounded to 11 bits: 1e-2.
- bfloat16: the same four roundings at 8 bits (RMS ~1e-3 each, ~3e-3 together): 2e-2.
- fp8 e4m3: activations are quantized twice at 4 bits (RMS ~2.7% each, ~4% together): 6e-2.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from moetune.errors import InvalidProblemError
from moetune.runtime.kernels.triton_config import (
    SPACE, check_config, with_prefix)
from moetune.runtime.vllm.configs import vllm_default_config
from moetune.runtime.platform import SKU, Vendor, detect_sku
from moetune.runtime.problem import DEFAULT_BUCKETS, MoEProblem, QuantScheme
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import rule_choice
from moetune.tuner.gate import relative_error, tolerance
from moetune.tuner.inputs import Routing, make_batch, make_weights
from tests.routing_checks import check_routing, random_ids, with_unrouted

HAS_GPU = torch.cuda.is_available() and not getattr(torch.version, "hip", None)
cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU: torch.cuda.is_available() is False")

TOLERANCE = {"float32": 5e-3, "float16": 1e-2, "bfloat16": 2e-2}
FP8_TOLERANCE = 6e-2


def tolerance(problem: MoEProblem) -> float:
    """The relative error a kernel may have from the float32 reference on ``problem``."""
    return FP8_TOLERANCE if problem.quant.is_fp8 else TOLERANCE[problem.dtype.value]


KERNELS = ["aiter_triton", "aiter_triton_split", "aiter_triton_silu_fused",
           "aiter_triton_gelu_fused", "aiter_triton_e2e", "torch_scaled_grouped",
           "aiter_triton_persistent", "aiter_triton_silu_fused_persistent",
           "aiter_triton_gelu_fused_persistent", "moetune_grouped", "moetune_grouped_mm",
           "vllm_triton_tuned"]
SHAPES = [
    MoEProblem(1, 256, 128, 8, 2, dtype="float16"),  # decode
    MoEProblem(3000, 384, 256, 128, 8),  # prefill, many experts
    MoEProblem(33, 200, 96, 256, 8),  # hidden not a multiple of 128 (nor of 16)
    MoEProblem(64, 256, 128, 8, 1, dtype="float32", router_weight_on_input=True),
    MoEProblem(17, 256, 128, 16, 2, activation="gelu", gated=False),
    MoEProblem(5, 256, 384, 256, 8, activation="gelu", gated=False, router_weight_on_input=True),
]
# A second GEMM config unlike the first: the split kernels then align the routing twice.
OTHER = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16,
         "num_warps": 8, "num_stages": 3}
E2E = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K1": 64, "BLOCK_SIZE_K2": 64,
       "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 2}
H200 = SKU(Vendor.NVIDIA, "H200", "sm_90", 132, 141 << 30)


def _problems() -> list[MoEProblem]:
    out = []
    for shape, quant in itertools.product(SHAPES, QuantScheme):
        try:
            out.append(dataclasses.replace(shape, quant=quant))
        except InvalidProblemError:  # block fp8 needs sizes divisible by 128
            continue
    return out


def _params(name: str, problem: MoEProblem) -> dict:
    if not default_registry.get(name).params:
        return {}
    default = vllm_default_config(problem)
    if name in ("aiter_triton", "vllm_triton_tuned"):
        return default
    if name == "aiter_triton_e2e":
        return E2E
    if name in ("moetune_decode", "moetune_decode_one"):
        return default_registry.get(name).seed_params(problem, H200)
    if name == "moetune_grouped":  # gate and up tiles of GEMM1 fit in float32 too
        return {**with_prefix({**OTHER, "BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64}, "g1_"),
                **with_prefix(OTHER, "g2_"), "REDUCE": "atomic"}
    return {**with_prefix(default, "g1_"), **with_prefix(OTHER, "g2_")}


@pytest.fixture(scope="module")
def gpu_sku() -> SKU:
    return detect_sku("cuda")


@cuda
@needs_gpu
@pytest.mark.parametrize("one_program_max", [0, None, 1 << 20],
                         ids=["three-launches", "as-served", "one-launch"])
def test_align_groups_every_routed_pair_on_the_gpu(one_program_max):
    """Both align paths compiled, at decode and DeepSeek-V3 prefill sizes (4096 tokens: 32768
    pairs) and a top-1 layer."""
    from moetune.runtime.kernels._align import ONE_PROGRAM_MAX, align

    limit = ONE_PROGRAM_MAX if one_program_max is None else one_program_max
    gen = torch.Generator().manual_seed(0)
    for m, topk, e, block in ((1, 8, 256, 16), (64, 8, 256, 64), (512, 8, 128, 16),
                              (4096, 8, 256, 64), (3000, 1, 128, 128)):
        ids = random_ids(m, topk, e, gen).cuda()
        check_routing(ids, block, e, align(ids, block, e, one_program_max=limit))


@cuda
@needs_gpu
@pytest.mark.parametrize("problem", _problems(), ids=lambda p: p.describe().replace(" ", "-"))
@pytest.mark.parametrize("name", KERNELS)
def test_kernel_matches_reference(name, problem, gpu_sku):
    kernel = default_registry.get(name)
    ok, why = kernel.supports(problem, gpu_sku)
    if not ok:
        pytest.skip(why)
    params = kernel.validate(_params(name, problem))
    assert kernel.check_params(problem, params) is None
    weights = make_weights(problem, "cuda", seed=1)
    batch = make_batch(problem, "cuda", seed=2, routing=Routing.ZIPF)
    ref = default_registry.get("reference").prepare(problem, {}, weights)(*batch.args())
    out = kernel.prepare(problem, params, weights)(*batch.args())
    torch.cuda.synchronize()
    assert out.dtype == batch.x.dtype and out.shape == batch.x.shape
    tol = tolerance(problem)
    err = relative_error(out, ref)
    assert err <= tol, f"{name} {problem.describe()}: relative error {err:.3g} > {tol}"


@cuda
@needs_gpu
def test_rule_kernel_runs_every_scheme_on_this_gpu(gpu_sku):
    """The baseline of every CUDA bucket must never silently fall back to the torch loop."""
    for problem in _problems():
        choice = rule_choice(problem, gpu_sku)
        own = default_registry.get("vllm_triton").supports(problem, gpu_sku)[0]
        want = "vllm_triton" if own else "aiter_triton"  # vLLM's path, else its emulation
        assert choice.kernel == want, (problem.describe(), choice.reason)


@cuda
@needs_gpu
def test_kernel_output_is_capturable_in_a_cuda_graph(gpu_sku):
    """Serving replays graphs: no host sync may hide in routing, quantization or the GEMMs."""
    problem = MoEProblem(24, 256, 128, 16, 2, quant="fp8_block_128x128")
    weights = make_weights(problem, "cuda", seed=1)
    batch = make_batch(problem, "cuda", seed=2)
    for name in ("aiter_triton", "aiter_triton_silu_fused", "moetune_grouped"):
        kernel = default_registry.get(name)
        fn = kernel.prepare(problem, kernel.validate(_params(name, problem)), weights)
        eager = fn(*batch.args())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*batch.args())
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, eager) < 1e-6, name


def _grouped_variants() -> list[tuple[MoEProblem, dict]]:
    """moetune_grouped's other points at the tiles of the fused default: the other reduces
    (atomics into the output, vLLM's separate sum: the same rows summed three ways) where there
    is a reduce, and ``g2_N_TILES=2`` everywhere (GEMM2's loop over (tile, K step), every
    scheme's epilogue once per tile; H = 200 leaves the second tile of each program part empty),
    and weight tiles through TMA descriptors, alone and with two tiles per GEMM2 program, where
    the rows are 16-byte aligned (H = 200 is not in fp8), with gate and up tiles in one box
    where the layer is gated (under block fp8 also with each half a whole 128-row scale
    block); block fp8 with tiles of 256 columns, spanning two 128-row scale blocks (the
    default's lie in one); GEMM2's programs in column-major order, with one and two tiles per
    program; GEMM2 on a persistent grid (two programs per SM walking single tiles, four walking
    two-tile units in column-major order); GEMM2's activation tiles through TMA from the
    intermediate in sorted order (GEMM1's row blocks, so GEMM2's are as tall), alone, with TMA weights and two tiles per program, and on the
    persistent grid, where its rows are 16-byte aligned; under block fp8, GEMM1's epilogue
    writing GEMM2's fp8 input and its scales (tiles of one and two 128-column groups, and with
    TMA loads of both GEMMs' tiles from the sorted intermediate)."""
    reduces = [(p, {"REDUCE": r}) for p in _problems() if p.topk > 1 and p.dtype.value != "float32"
               for r in ("atomic_out", "sum")]
    tma = [(p, {"W_TMA": 1, **tiles}) for p in _problems() if p.hidden_size % 16 == 0
           for tiles in ({}, {"g2_N_TILES": 2})]
    pairs = [(p, {"W_TMA": 1, "g1_PAIR_TMA": 1, **tile}) for p in _problems()
             if p.hidden_size % 16 == 0 and p.gated
             for tile in ({}, {"g1_BLOCK_SIZE_N": 128})
             if not tile or p.quant is QuantScheme.FP8_BLOCK_128X128]
    wide = [(p, {"g1_BLOCK_SIZE_N": 256, "g2_BLOCK_SIZE_N": 256, "g2_BLOCK_SIZE_K": 64})
            for p in _problems() if p.quant is QuantScheme.FP8_BLOCK_128X128]
    column_major = [(p, {"g2_N_MAJOR": 1, **tiles}) for p in _problems()
                    for tiles in ({}, {"g2_N_TILES": 2})]
    persistent = [(p, {"g2_PERSISTENT": programs, "g2_N_MAJOR": order, "g2_N_TILES": tiles})
                  for p in _problems() for programs, order, tiles in ((2, 0, 1), (4, 1, 2))]
    activations = [(p, {"g2_A_TMA": 1, "g2_BLOCK_SIZE_M": 16, **more}) for p in _problems()
                   if p.intermediate_size % 16 == 0
                   for more in ({}, {"W_TMA": 1, "g2_N_TILES": 2}, {"g2_PERSISTENT": 2})
                   if not more.get("W_TMA") or p.hidden_size % 16 == 0]
    fp8_out = [(p, {"g1_FP8_OUT": 1, **more}) for p in _problems()
               if p.quant is QuantScheme.FP8_BLOCK_128X128
               for more in ({"g1_BLOCK_SIZE_N": 128}, {"g1_BLOCK_SIZE_N": 256},
                            {"g1_BLOCK_SIZE_N": 128, "W_TMA": 1, "g1_PAIR_TMA": int(p.gated),
                             "g2_A_TMA": 1, "g2_BLOCK_SIZE_M": 16})]
    return (reduces + [(p, {"g2_N_TILES": 2}) for p in _problems()] + tma + pairs + wide
            + column_major + persistent + activations + fp8_out)


@cuda
@needs_gpu
@pytest.mark.parametrize("problem,override", _grouped_variants(),
                         ids=lambda v: v.describe().replace(" ", "-") if isinstance(v, MoEProblem)
                         else ",".join(f"{k}={x}" for k, x in v.items()))
def test_grouped_variants_match_reference(problem, override, gpu_sku):
    kernel = default_registry.get("moetune_grouped")
    ok, why = kernel.supports(problem, gpu_sku)
    if not ok:
        pytest.skip(why)
    params = kernel.validate({**_params("moetune_grouped", problem), **override})
    assert kernel.check_params(problem, params) is None
    weights = make_weights(problem, "cuda", seed=1)
    batch = make_batch(problem, "cuda", seed=2, routing=Routing.ZIPF)
    ref = default_registry.get("reference").prepare(problem, {}, weights)(*batch.args())
    out = kernel.prepare(problem, params, weights)(*batch.args())
    tol = tolerance(problem)
    assert relative_error(out, ref) <= tol


# (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, num_stages) on both sides of 227 KiB in bfloat16.
BOUNDARY = [(128, 256, 64, 4), (128, 256, 64, 5), (256, 128, 64, 4), (256, 128, 64, 5),
            (128, 128, 128, 3), (128, 128, 128, 4), (64, 256, 128, 2), (64, 256, 128, 3),
            (256, 256, 64, 3), (256, 256, 64, 4), (64, 64, 256, 5), (128, 64, 256, 4)]


@cuda
@needs_gpu
@pytest.mark.parametrize("tile", BOUNDARY, ids=str)
def test_shared_memory_check_agrees_with_the_compiler(tile, gpu_sku):
    """Configs the check keeps must compile, and those it drops must not: either error would
    cost the tuner (a crash mid-search, or lost candidates)."""
    block_m, block_n, block_k, stages = tile
    problem = MoEProblem(64, 512, 256, 8, 2)
    config = {"BLOCK_SIZE_M": block_m, "BLOCK_SIZE_N": block_n, "BLOCK_SIZE_K": block_k,
              "GROUP_SIZE_M": 1, "num_warps": 8, "num_stages": stages}
    weights = make_weights(problem, "cuda", seed=1)
    batch = make_batch(problem, "cuda", seed=2)
    try:
        default_registry.get("aiter_triton").prepare(problem, config, weights)(*batch.args())
        torch.cuda.synchronize()
        compiled = None
    except Exception as e:  # noqa: BLE001 - Triton's OutOfResources, by name across versions
        compiled = f"{type(e).__name__}: {e}"
    kept = check_config(problem, config)
    assert (kept is None) == (compiled is None), f"check: {kept}; compiler: {compiled}"


@pytest.mark.parametrize("quant", list(QuantScheme))
def test_vllm_default_configs_are_in_the_declared_space(quant):
    """Every heuristic config, at every bucket, is a valid point that fits in shared memory: the
    rule's baseline must never be a config the tuner could not store or compile."""
    kernel = default_registry.get("aiter_triton")
    for m, (h, i, e, topk) in itertools.product(DEFAULT_BUCKETS, [(4096, 14336, 8, 2),
                                                                   (7168, 256, 256, 8)]):
        problem = MoEProblem(m, h, i, e, topk, quant=quant)
        config = vllm_default_config(problem)
        assert kernel.validate(config) == config
        assert kernel.check_params(problem, config) is None, (m, config)
        assert set(config) == set(SPACE)


def test_shared_memory_constraint_drops_what_cannot_compile():
    problem = MoEProblem(64, 4096, 14336, 8, 2)
    big = {"BLOCK_SIZE_M": 256, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 1,
           "num_warps": 8, "num_stages": 5}
    assert "shared memory" in check_config(problem, big)
    fp8_block = dataclasses.replace(problem, quant="fp8_block_128x128")
    assert "spans two" in check_config(fp8_block, dict(big, BLOCK_SIZE_M=16, BLOCK_SIZE_N=64,
                                                       num_stages=2))
    kept = sum(check_config(problem, dict(zip(SPACE, values))) is None
               for values in itertools.product(*SPACE.values()))
    assert 0 < kept < 1920


def test_cuda_rule_emulation_picks_the_triton_kernel_with_vllms_config(monkeypatch):
    """Where vLLM's own path cannot run, the rule on a (described) H200 is aiter_triton with
    vLLM's config: its tuned file where the installed vLLM ships one (or
    VLLM_TUNED_CONFIG_FOLDER has one), else its default. aiter and triton are test
    requirements, so aiter's Triton modules load here and on the GPU."""
    from moetune.runtime.kernels.vllm_triton import VllmTritonKernel
    from moetune.runtime.vllm.configs import tuned_config

    monkeypatch.setattr(VllmTritonKernel, "_supports_device",
                        classmethod(lambda cls, problem, sku: "vLLM's CUDA ops are not here"))
    problem = MoEProblem(256, 4096, 14336, 8, 2)
    choice = rule_choice(problem, H200)
    assert choice.kernel == "aiter_triton", choice.reason
    tuned = tuned_config(problem, H200)
    assert choice.params == (tuned[0] if tuned else vllm_default_config(problem))
    assert ("tuned config" if tuned else "default config") in choice.reason


GRAPH_SAFE = [n for n in default_registry.names() if default_registry.get(n).graph_safe]


def _capture(fn, static: tuple) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of ``fn`` on ``static`` as vLLM captures one: a first call on a side stream
    compiles and allocates outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(*static)
    return graph, captured


@cuda
@needs_gpu
@pytest.mark.parametrize("problem", [MoEProblem(33, 256, 128, 8, 2),
                                     MoEProblem(5, 256, 256, 16, 2, quant="fp8_block_128x128")],
                         ids=lambda p: p.describe().replace(" ", "-"))
@pytest.mark.parametrize("name", GRAPH_SAFE)
def test_graph_safe_kernels_replay_a_captured_graph_on_new_inputs(name, problem, gpu_sku):
    """``graph_safe`` is what lets serving run a winner while vLLM captures CUDA graphs: the
    captured call, replayed on inputs copied into its buffers, must compute what an eager call
    on those inputs computes (no host sync at capture, no routing baked in)."""
    kernel = default_registry.get(name)
    ok, why = kernel.supports(problem, gpu_sku)
    if not ok:
        pytest.skip(why)
    params = {"torch_dense": {"chunk_tokens": 32}}.get(name) or _params(name, problem)
    fn = kernel.prepare(problem, kernel.validate(params), make_weights(problem, "cuda", seed=1))
    static = make_batch(problem, "cuda", seed=2, routing=Routing.ZIPF).args()
    graph, captured = _capture(fn, static)
    fresh = make_batch(problem, "cuda", seed=3).args()  # other tokens, other experts
    for buffer, value in zip(static, fresh):
        buffer.copy_(value)
    graph.replay()
    eager = fn(*fresh)
    torch.cuda.synchronize()
    assert relative_error(captured, eager) <= 1e-6, name


SKIPS_UNROUTED = [n for n in default_registry.names() if default_registry.get(n).skips_unrouted]


@cuda
@needs_gpu
@pytest.mark.parametrize("problem", [MoEProblem(4, 256, 128, 8, 2),
                                     MoEProblem(33, 256, 128, 8, 2),
                                     MoEProblem(5, 256, 256, 16, 2, quant="fp8_block_128x128")],
                         ids=lambda p: p.describe().replace(" ", "-"))
@pytest.mark.parametrize("name", SKIPS_UNROUTED)
@pytest.mark.parametrize("reduce", ["seed", "atomic", "atomic_out", "sum"])
def test_kernels_skipping_unrouted_slots_run_vllms_padded_batches_and_its_capture(
        name, problem, reduce, gpu_sku):
    """What vLLM does with a kernel that takes slots routed nowhere (id -1) as they are: eager
    calls give each row the reference's without those slots and zeros where none is routed
    (their activations, NaN, unread); a CUDA graph captured on a batch routed nowhere at all
    (vLLM's capture), replayed on real routing and on routing with padding rows, computes what
    eager calls on those inputs compute."""
    kernel = default_registry.get(name)
    ok, why = kernel.supports(problem, gpu_sku)
    if not ok:
        pytest.skip(why)
    params = _params(name, problem)
    if reduce != "seed":
        if name != "moetune_grouped":
            pytest.skip("the reduces named are moetune_grouped's")
        params = {**params, "REDUCE": reduce}
    params = kernel.validate(params)
    if kernel.check_params(problem, params) is not None:
        pytest.skip(kernel.check_params(problem, params))
    weights = make_weights(problem, "cuda", seed=1)
    fn = kernel.prepare(problem, params, weights)
    reference = default_registry.get("reference").prepare(problem, {}, weights)
    batch = make_batch(problem, "cuda", seed=2).args()
    padded, ref_call, empty = with_unrouted(*batch)
    out = torch.full_like(batch[0], float("nan"))
    fn(*padded, out=out)
    assert (out[empty] == 0).all()
    assert relative_error(out, reference(*ref_call)) <= tolerance(problem)
    capture, _, _ = with_unrouted(*batch, rows=())
    static = tuple(t.clone() for t in capture)
    graph, captured = _capture(fn, static)
    graph.replay()
    torch.cuda.synchronize()
    assert (captured == 0).all()
    for inputs in (make_batch(problem, "cuda", seed=3).args(), padded):
        for buffer, value in zip(static, inputs):
            buffer.copy_(value)
        graph.replay()
        eager = fn(*inputs)
        torch.cuda.synchronize()
        assert relative_error(captured, eager) <= 1e-6, name


@cuda
@needs_gpu
@pytest.mark.parametrize("rows,cols,group", [(37, 256, 128), (4096, 256, 128), (5, 7168, 128),
                                             (3, 1024, None), (70, 384, 128), (1, 5120, None)])
def test_activation_quant_matches_torch_per_group(rows, cols, group):
    """Several rows per program where rows are narrow (37 rows of 256: the last program part
    empty), one where wide; each group's scale is its max over 448, and every value rounds to
    the nearest fp8 step (within the division's rounding); an all-zero row gets a tiny scale
    and zeros, not NaN."""
    from moetune.runtime.kernels._act_quant import FP8, quantize_rows

    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 3
    x[rows // 2] = 0
    q, scale = quantize_rows(x, group)
    size = group or cols
    groups = x.float().view(rows, -1, size)
    expected = groups.abs().amax(-1).clamp(min=1e-12) / torch.finfo(FP8).max
    torch.testing.assert_close(scale, expected, rtol=1e-6, atol=0)
    reference = (groups / expected[..., None]).to(FP8).float()
    got = q.float().view(rows, -1, size)
    assert torch.isfinite(got).all() and (got[rows // 2] == 0).all()
    # The kernel divides with at most an ulp of difference: a value on a rounding boundary may
    # land one fp8 step away, nothing more (steps are at most 1/8 of the value).
    assert ((got - reference).abs() <= reference.abs() / 8 + 2 ** -9).all()  # or a subnormal step
    assert (got != reference).float().mean() < 1e-3


@cuda
@needs_gpu
def test_activation_quant_up_to_a_count_on_the_device():
    """A padded layout (the sorted intermediate of ``g2_A_TMA``) is quantized up to a count
    the kernel reads: the rows before it, including those of a program the count cuts (16 rows
    of 256 per program), are those of a full quantization, per group and per row."""
    from moetune.runtime.kernels._act_quant import quantize_rows

    x = torch.randn(100, 256, device="cuda", dtype=torch.bfloat16)
    used = torch.tensor([37], device="cuda", dtype=torch.int32)
    full_q, full_scale = quantize_rows(x, 128)
    q, scale = quantize_rows(x, 128, used)
    assert torch.equal(q[:37].float(), full_q[:37].float())
    assert torch.equal(scale[:37], full_scale[:37])
    q2, scale2 = quantize_rows(x, None, used)
    assert torch.equal(scale2[:37], quantize_rows(x)[1][:37])


# --- moetune_decode at the decode sizes and model shapes it is for ------------------------------
# TP8 shards where the model is sharded; bf16 activations. Each shape runs every quant scheme.
DECODE_SHAPES = {
    "llama4-maverick-tp8": MoEProblem(1, 5120, 1024, 128, 1, router_weight_on_input=True),
    "deepseek-v3-tp8": MoEProblem(1, 7168, 256, 256, 8),
    "qwen3-30b-a3b": MoEProblem(1, 2048, 768, 128, 8),
}
DECODE_TOKENS = (1, 4, 16)


def _kept(kernel: type, problem: MoEProblem, variants: list[dict]) -> list[dict]:
    """``variants`` that ``kernel``'s constraints keep at ``problem``, each once, in order."""
    unique: list[dict] = []
    for params in variants:
        if kernel.check_params(problem, params) is None and params not in unique:
            unique.append(params)
    return unique


def _decode_variants(problem: MoEProblem) -> list[dict]:
    """The seed config and its reduce and split-K variants that the constraints keep, each
    also with GEMM2 launched while GEMM1 runs (``PDL``)."""
    kernel = default_registry.get("moetune_decode")
    seed = kernel.seed_params(problem, H200)
    variants = [seed] + [dict(seed, SPLIT_K=s, REDUCE=r) for s in (1, 2, 4)
                         for r in ("atomic", "atomic_out", "ordered")]
    variants += [dict(v, PDL=1) for v in variants]
    return _kept(kernel, problem, variants)


@cuda
@needs_gpu
@pytest.mark.parametrize("quant", list(QuantScheme), ids=lambda q: q.value)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=str)
def test_decode_kernel_passes_the_tuners_gate_at_model_shapes(shape, quant, gpu_sku):
    """Every scheme at M = 1, 4, 16 (skewed routing: several pairs share an expert), with each
    reduce and split-K, against the float32 reference with the tuner's own tolerance."""
    kernel = default_registry.get("moetune_decode")
    base = dataclasses.replace(DECODE_SHAPES[shape], quant=quant)
    weights = make_weights(base, "cuda", seed=1)
    reference = default_registry.get("reference").prepare(base, {}, weights)
    failures = []
    for m in DECODE_TOKENS:
        problem = base.with_tokens(m)
        ok, why = kernel.supports(problem, gpu_sku)
        assert ok, why
        batch = make_batch(problem, "cuda", seed=2 + m, routing=Routing.ZIPF)
        ref = reference(*batch.args())
        for params in _decode_variants(problem):
            out = kernel.prepare(problem, kernel.validate(params), weights)(*batch.args())
            torch.cuda.synchronize()
            err = relative_error(out, ref)
            if out.dtype != batch.x.dtype or not err <= tolerance(problem):
                failures.append(f"M={m} {params}: error {err:.3g} > {tolerance(problem)}")
    assert not failures, "\n".join(failures)


@cuda
@needs_gpu
def test_decode_kernel_replays_in_a_graph_with_each_reduce(gpu_sku):
    """The accumulator is zeroed inside GEMM1 and the expert ids read on the device: a captured
    call replayed on new routing computes what an eager call does, for every reduce (bit for
    bit where the reduce is ordered; atomics add in any order, so there within the gate)."""
    problem = MoEProblem(4, 2048, 768, 128, 8, quant="fp8_block_128x128")
    kernel = default_registry.get("moetune_decode")
    weights = make_weights(problem, "cuda", seed=1)
    reference = default_registry.get("reference").prepare(problem, {}, weights)
    for params in _decode_variants(problem):
        fn = kernel.prepare(problem, params, weights)
        static = make_batch(problem, "cuda", seed=2).args()
        fn(*static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fn(*static)
        for buffer, value in zip(static, make_batch(problem, "cuda", seed=3).args()):
            buffer.copy_(value)
        graph.replay()
        graph.replay()  # twice: the atomics must start from zero each time
        eager = fn(*static)
        torch.cuda.synchronize()
        assert relative_error(captured, reference(*static)) <= tolerance(problem), params
        same = 0.0 if params["REDUCE"] == "ordered" else tolerance(problem)
        assert relative_error(captured, eager) <= max(same, 1e-6), params


# --- moetune_decode_one: one persistent launch at 1-8 tokens ------------------------------------
ONE_TOKENS = (1, 2, 4, 8)


def _one_variants(problem: MoEProblem) -> list[dict]:
    """The seed and its grid and warp variants that the constraints keep (programs per SM up to
    4 and 8 warps: the launcher must cap what is not resident, or the spin-waits hang)."""
    kernel = default_registry.get("moetune_decode_one")
    seed = kernel.seed_params(problem, H200)
    variants = [seed] + [dict(seed, PROGRAMS_PER_SM=p) for p in (1, 4)]
    variants += [dict(seed, num_warps=8, PROGRAMS_PER_SM=4, num_stages=3)]
    return _kept(kernel, problem, variants)


@cuda
@needs_gpu
@pytest.mark.parametrize("quant", list(QuantScheme), ids=lambda q: q.value)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=str)
def test_one_launch_kernel_passes_the_tuners_gate_at_model_shapes(shape, quant, gpu_sku):
    """Every scheme at M = 1, 2, 4, 8 (skewed routing), written into a NaN-filled ``out``."""
    kernel = default_registry.get("moetune_decode_one")
    base = dataclasses.replace(DECODE_SHAPES[shape], quant=quant)
    weights = make_weights(base, "cuda", seed=1)
    reference = default_registry.get("reference").prepare(base, {}, weights)
    failures = []
    for m in ONE_TOKENS:
        problem = base.with_tokens(m)
        ok, why = kernel.supports(problem, gpu_sku)
        assert ok, why
        batch = make_batch(problem, "cuda", seed=2 + m, routing=Routing.ZIPF)
        ref = reference(*batch.args())
        for params in _one_variants(problem):
            out = torch.full_like(batch.x, float("nan"))
            got = kernel.prepare(problem, kernel.validate(params), weights)(*batch.args(), out=out)
            torch.cuda.synchronize()
            err = relative_error(out, ref)
            if got is not out or not err <= tolerance(problem):
                failures.append(f"M={m} {params}: error {err:.3g} > {tolerance(problem)}")
    assert not failures, "\n".join(failures)


@cuda
@needs_gpu
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=str)
def test_one_launch_kernel_resets_its_counters_between_calls(shape, gpu_sku):
    """50 back-to-back calls without a sync, each on new routing, then each checked: a counter
    left over from one call would let the next read an unfinished row or reduce too early.
    The counters are zero afterwards."""
    problem = DECODE_SHAPES[shape].with_tokens(8 if DECODE_SHAPES[shape].topk == 8 else 4)
    kernel = default_registry.get("moetune_decode_one")
    weights = make_weights(problem, "cuda", seed=1)
    reference = default_registry.get("reference").prepare(problem, {}, weights)
    for params in _one_variants(problem):
        fn = kernel.prepare(problem, params, weights)
        batches = [make_batch(problem, "cuda", seed=s).args() for s in range(50)]
        outs = [fn(*b) for b in batches]
        torch.cuda.synchronize()
        errors = [relative_error(o, reference(*b)) for o, b in zip(outs, batches)]
        assert max(errors) <= tolerance(problem), (params, errors)
        counters = [c.cell_contents for c in fn.__closure__
                    if isinstance(c.cell_contents, torch.Tensor)
                    and c.cell_contents.dtype == torch.int32]
        assert counters and not any(c.any() for c in counters), params


@cuda
@needs_gpu
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=str)
def test_one_launch_kernel_replays_in_a_graph_bit_for_bit(shape, gpu_sku):
    """A captured call replayed 5 times on new routing equals an eager call bit for bit (the
    reduce is ordered), into the ``out`` it was captured with; the counters reset inside."""
    problem = DECODE_SHAPES[shape].with_tokens(2)
    kernel = default_registry.get("moetune_decode_one")
    weights = make_weights(problem, "cuda", seed=1)
    reference = default_registry.get("reference").prepare(problem, {}, weights)
    for params in _one_variants(problem):
        fn = kernel.prepare(problem, params, weights)
        static = make_batch(problem, "cuda", seed=2).args()
        out = torch.empty_like(static[0])
        fn(*static, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*static, out=out)
        for seed in range(3, 8):
            for buffer, value in zip(static, make_batch(problem, "cuda", seed=seed).args()):
                buffer.copy_(value)
            graph.replay()
            replayed = out.clone()
            eager = fn(*static)
            torch.cuda.synchronize()
            assert relative_error(replayed, reference(*static)) <= tolerance(problem), params
            assert torch.equal(replayed, eager), (params, seed)


#: Kernels that say two calls give the same bits (``run_to_run`` is None), each where a run could
#: reorder a sum: top-8 rows meeting many partials in a fixed order, moetune's atomics at two
#: addends (``0 + a + b`` is ``0 + b + a``), block fp8's scaled partials. Serving under
#: ``MOETUNE_DETERMINISTIC=1`` and ``tune --deterministic`` trust these verdicts.
TOP8 = MoEProblem(512, 384, 256, 64, 8)
REPEATS = [
    ("moetune_grouped", TOP8, {"REDUCE": "sum"}),
    ("moetune_grouped", dataclasses.replace(TOP8, quant="fp8_block_128x128"), {"REDUCE": "sum"}),
    ("moetune_grouped", MoEProblem(512, 384, 256, 8, 2), {"REDUCE": "atomic_out"}),
    ("moetune_decode", MoEProblem(4, 384, 256, 64, 8), {"REDUCE": "ordered", "SPLIT_K": 2,
                                                          "g2_BLOCK_K": 128}),
    ("moetune_decode_one", MoEProblem(4, 384, 256, 64, 8), {}),
    ("moetune_grouped_mm", TOP8, {}),
    ("aiter_triton", TOP8, {}),
    ("vllm_triton", TOP8, {}),
    ("torch_grouped", TOP8, {}),
]


@cuda
@needs_gpu
@pytest.mark.parametrize("name,problem,override", REPEATS,
                         ids=[f"{n}-{p.describe()}-{o}".replace(" ", "-") for n, p, o in REPEATS])
def test_a_kernel_that_says_it_repeats_gives_the_same_bits_in_every_call(
        name, problem, override, gpu_sku):
    kernel = default_registry.get(name)
    ok, why = kernel.supports(problem, gpu_sku)
    if not ok:
        pytest.skip(why)
    params = kernel.validate({**_params(name, problem), **override})
    assert kernel.check_params(problem, params) is None
    assert kernel.run_to_run(problem, params) is None
    weights = make_weights(problem, "cuda", seed=1)
    batch = make_batch(problem, "cuda", seed=2, routing=Routing.ZIPF).args()
    fn = kernel.prepare(problem, params, weights)
    first = fn(*batch).clone()
    for _ in range(20):
        assert torch.equal(fn(*batch), first)
