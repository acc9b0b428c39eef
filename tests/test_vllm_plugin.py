"""The plugin's hook logic against a stand-in experts class: fast, and no vLLM needed.

The stand-in has the exact ``apply`` and ``process_weights_after_loading`` signatures of vLLM
0.32's CPU experts and "prepacks" (zeroes) the layer's weights at load, as vLLM's does (its
packed layout is not plain), so a kernel run on the wrong weights shows up as a wrong output.
``tests/test_vllm_contract.py`` runs the same hook on vLLM's real classes.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moetune.errors import TableError
from moetune.runtime import dispatcher as dispatcher_module
from moetune.runtime import rules
from moetune.runtime.kernels.base import MoEWeights
from moetune.runtime.kernels.torch_grouped import TorchGroupedKernel
from moetune.runtime.platform import detect_sku
from moetune.runtime.problem import MoEProblem, Shape
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import rule_choice
from moetune.runtime.vllm import classes, versions
from moetune.serving import hook, op, plugin
from moetune.serving.settings import Mode, Settings
from moetune.serving.state import PluginState

from tests.vllm_tables import write_winners

H, I, E, TOPK = 64, 32, 4, 2
SHAPE = Shape(H, I, E, TOPK, "float32", "none", "silu", True, False)


class FakeExperts:
    """vLLM 0.32's experts contract, with vLLM's kernel replaced by the float32 reference."""

    def __init__(self, topk: int = TOPK, quantized: bool = False) -> None:
        self.moe_config = SimpleNamespace(activation=SimpleNamespace(value="silu"),
                                          in_dtype=torch.float32, experts_per_token=topk,
                                          moe_parallel_config=SimpleNamespace(use_ep=False))
        self.quant_config = SimpleNamespace(is_quantized=quantized,
                                            weight_quant_dtype="fp8" if quantized else None,
                                            gemm1_alpha=None, gemm1_clamp_limit=None)
        self.w1_bias = self.w2_bias = None
        self.vllm_calls = 0

    def process_weights_after_loading(self, layer):
        self.plain = MoEWeights(layer.w13_weight.clone(), layer.w2_weight.clone())
        layer.w13_weight = torch.zeros_like(layer.w13_weight)  # "prepacked"
        layer.w2_weight = torch.zeros_like(layer.w2_weight)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        self.vllm_calls += 1
        output.copy_(reference(self.plain, hidden_states, topk_weights, topk_ids,
                               apply_router_weight_on_input))


def reference(weights, x, topk_weights, topk_ids, on_input=False):
    problem = MoEProblem(x.shape[0], H, I, E, topk_ids.shape[1], "float32",
                         router_weight_on_input=on_input)
    if on_input:  # vLLM's prepare step already scaled the input
        topk_weights = torch.ones_like(topk_weights)
    return default_registry.get("reference").prepare(problem, {}, weights)(x, topk_weights,
                                                                             topk_ids)


@pytest.fixture
def fake_vllm(monkeypatch):
    """A module holding a fresh FakeExperts class, and the spec that hooks it."""
    cls = type("FakeExperts", (FakeExperts,), {"apply": FakeExperts.apply,
               "process_weights_after_loading": FakeExperts.process_weights_after_loading})
    module = types.ModuleType("fake_vllm_experts")
    module.FakeExperts = cls
    monkeypatch.setitem(sys.modules, "fake_vllm_experts", module)
    return cls, classes.ExpertsSpec("fake_vllm_experts", "FakeExperts",
                                    classes.Held.CPU_PREPACKED, True)


@pytest.fixture
def table(tmp_path, cpu_sku) -> Path:
    return write_winners(tmp_path / "t.db", SHAPE, (1, 4, 16), "torch_grouped", sku=cpu_sku)


def make_layer(cls, on_input=False, topk=TOPK, **kw):
    torch.manual_seed(0)
    experts = cls(topk=topk, **kw)
    layer = SimpleNamespace(w13_weight=torch.randn(E, 2 * I, H) / 8,
                            w2_weight=torch.randn(E, H, I) / 8,
                            apply_router_weight_on_input=on_input)
    experts.process_weights_after_loading(layer)
    return experts, layer


def call(experts, layer, m, expert_map=None, on_input=False, topk=TOPK, positional=False):
    """One MoE call as vLLM makes it (every argument by keyword), checked against the reference."""
    x = torch.randn(m, H)
    topk_weights = torch.rand(m, topk)
    topk_ids = torch.stack([torch.randperm(E)[:topk] for _ in range(m)]).to(torch.int32)
    out = torch.empty(m, H)
    args = dict(output=out, hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight,
                topk_weights=topk_weights, topk_ids=topk_ids, activation=None,
                global_num_experts=E, expert_map=expert_map, a1q_scale=None, a2_scale=None,
                workspace13=None, workspace2=None, expert_tokens_meta=None,
                apply_router_weight_on_input=on_input)
    if positional:
        experts.apply(*args.values())
    else:
        experts.apply(**args)
    torch.testing.assert_close(out, reference(experts.plain, x, topk_weights, topk_ids, on_input))


def install(state, spec):
    assert hook.install(state, (spec,)) == ["FakeExperts"]


def test_winner_runs_on_plain_weights_kept_at_load(fake_vllm, table):
    cls, spec = fake_vllm
    state = PluginState(Settings(table=table))
    install(state, spec)
    install(state, spec)  # idempotent: wrapped once
    assert getattr(cls.apply, hook._MARK) is FakeExperts.apply
    experts, layer = make_layer(cls)
    for m in (1, 3, 16, 40):
        call(experts, layer, m)
    assert experts.vllm_calls == 0
    assert state.counts == {"H=64 I=32 E=4 topk=2 float32 none silu":
                            {"hit": 4, "miss": 0, "fallback": 0}}
    assert state.plain_copy_bytes == (E * 2 * I * H + E * H * I) * 4


def rule_kernel(m=1):
    """The CPU rule's pick for SHAPE: vLLM's own kernel where vLLM is installed."""
    choice = rule_choice(SHAPE.problem(m), detect_sku("cpu"))
    return choice.kernel, choice.params


def test_winner_that_is_the_rule_pick_runs_vllms_own_apply_without_a_copy(fake_vllm, tmp_path):
    """The rule's pick is what vLLM runs: calling vLLM's apply is that kernel, minus a copy."""
    cls, spec = fake_vllm
    state = PluginState(Settings(table=write_winners(tmp_path / "t.db", SHAPE, (1, 4, 16),
                                                     *rule_kernel())))
    install(state, spec)
    experts, layer = make_layer(cls)
    for m in (1, 3, 16, 40):
        call(experts, layer, m)
    assert experts.vllm_calls == 4
    assert state.counts == {"H=64 I=32 E=4 topk=2 float32 none silu":
                            {"hit": 4, "miss": 0, "fallback": 0}}
    assert state.plain_copy_bytes == 0


def test_only_winners_that_beat_the_rule_pick_run_through_moetune(fake_vllm, tmp_path):
    cls, spec = fake_vllm
    table = write_winners(tmp_path / "t.db", SHAPE, (1, 4), *rule_kernel())
    write_winners(table, SHAPE, (16,), "torch_grouped")
    state = PluginState(Settings(table=table))
    install(state, spec)
    experts, layer = make_layer(cls)
    for m in (1, 3, 16, 40):  # 1 and 3: the rule's pick (vLLM); 16 and 40: torch_grouped
        call(experts, layer, m)
    assert experts.vllm_calls == 2
    assert next(iter(state.counts.values())) == {"hit": 4, "miss": 0, "fallback": 0}
    assert state.plain_copy_bytes == (E * 2 * I * H + E * H * I) * 4


@pytest.mark.parametrize("kernel,params,vllm_calls", [
    ("torch_grouped", {}, 1),  # bincount reads back to the host: vLLM's kernel is captured
    ("torch_dense", {"chunk_tokens": 32}, 0),  # graph-safe: the winner is captured
])
def test_only_graph_safe_winners_run_during_cuda_graph_capture(fake_vllm, tmp_path, monkeypatch,
                                                               kernel, params, vllm_calls):
    assert default_registry.get(kernel).graph_safe is (vllm_calls == 0)
    cls, spec = fake_vllm
    monkeypatch.setattr(hook, "_capture_probe", lambda: lambda: True)  # always capturing
    state = PluginState(Settings(table=write_winners(tmp_path / "t.db", SHAPE, (4,), kernel,
                                                     params)))
    install(state, spec)
    experts, layer = make_layer(cls)
    call(experts, layer, 4)
    assert experts.vllm_calls == vllm_calls
    assert next(iter(state.counts.values()))["fallback" if vllm_calls else "hit"] == 1


def test_shape_not_in_table_is_a_miss_and_is_recorded_once(fake_vllm, table, tmp_path):
    cls, spec = fake_vllm
    misses = tmp_path / "misses.jsonl"
    state = PluginState(Settings(mode=Mode.RECORD, table=table, misses=misses))
    install(state, spec)
    experts, layer = make_layer(cls, topk=1)  # topk 1: another shape than the table's
    for m in (5, 5, 6, 100):
        call(experts, layer, m, topk=1)
    assert experts.vllm_calls == 4
    (counts,) = state.counts.values()
    assert counts == {"hit": 0, "miss": 4, "fallback": 0}
    assert not misses.exists()  # the forward pass does no I/O: written at exit
    state.report()
    rows = [json.loads(line) for line in misses.read_text().splitlines()]
    assert [r["num_tokens"] for r in rows] == [4, 96]  # 5 and 6 share bucket 4
    assert MoEProblem.from_row(rows[0]).shape == Shape(H, I, E, 1, "float32", "none", "silu",
                                                       True, False)
    again = PluginState(Settings(mode=Mode.RECORD, table=table, misses=misses))
    again.record_miss(MoEProblem.from_row(rows[1]))  # another process: no duplicate line
    again.misses.flush()
    assert len(misses.read_text().splitlines()) == 2


def test_neighbour_winner_runs_but_bucket_is_recorded(fake_vllm, table, tmp_path):
    cls, spec = fake_vllm
    misses = tmp_path / "misses.jsonl"
    state = PluginState(Settings(mode=Mode.RECORD, table=table, misses=misses))
    install(state, spec)
    experts, layer = make_layer(cls)
    call(experts, layer, 256)
    assert experts.vllm_calls == 0
    state.report()
    assert [json.loads(line)["num_tokens"] for line in misses.read_text().splitlines()] == [256]


def test_failing_kernel_falls_back_for_good(fake_vllm, table, monkeypatch, caplog):
    cls, spec = fake_vllm

    def broken(problem, params, weights):
        def run(x, w, ids, out=None):
            raise RuntimeError("boom")
        return run

    monkeypatch.setattr(TorchGroupedKernel, "prepare", staticmethod(broken))
    state = PluginState(Settings(table=table))
    install(state, spec)
    experts, layer = make_layer(cls)
    call(experts, layer, 4)
    call(experts, layer, 4)
    assert experts.vllm_calls == 2
    (counts,) = state.counts.values()
    assert counts == {"hit": 0, "miss": 0, "fallback": 2}
    assert len([r for r in caplog.records if "boom" in r.getMessage()]) == 1


def test_expert_parallel_calls_fall_back(fake_vllm, table):
    cls, spec = fake_vllm
    state = PluginState(Settings(table=table))
    install(state, spec)
    experts, layer = make_layer(cls)
    call(experts, layer, 4, expert_map=torch.arange(E))
    assert experts.vllm_calls == 1
    assert next(iter(state.counts.values()))["fallback"] == 1


def test_router_weight_on_input_is_not_applied_twice(fake_vllm, tmp_path, cpu_sku):
    cls, spec = fake_vllm
    shape = Shape(H, I, E, 1, "float32", "none", "silu", True, True)
    state = PluginState(Settings(table=write_winners(tmp_path / "t.db", shape, (8,),
                                                     "torch_loop", sku=cpu_sku)))
    install(state, spec)
    experts, layer = make_layer(cls, on_input=True, topk=1)
    call(experts, layer, 8, on_input=True, topk=1)
    assert experts.vllm_calls == 0


def test_quantized_layers_are_left_to_vllm(fake_vllm, table):
    cls, spec = fake_vllm
    state = PluginState(Settings(table=table))
    install(state, spec)
    experts, layer = make_layer(cls, quantized=True)
    call(experts, layer, 4)
    assert experts.vllm_calls == 1
    assert state.counts == {"not handled: quantized (fp8)": {"hit": 0, "miss": 1, "fallback": 0}}


def test_traced_apply_goes_through_one_opaque_op(fake_vllm, table):
    """vLLM on the CPU lets torch.compile(fullgraph=True) trace into the experts' apply."""
    cls, spec = fake_vllm
    state = PluginState(Settings(table=table))
    install(state, spec)
    experts, layer = make_layer(cls)
    empty = torch.empty(0)

    def forward(out, x, topk_weights, topk_ids):
        experts.apply(output=out, hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight,
                      topk_weights=topk_weights, topk_ids=topk_ids,
                      activation=experts.moe_config.activation, global_num_experts=E,
                      expert_map=None, a1q_scale=None, a2_scale=None, workspace13=empty,
                      workspace2=empty, expert_tokens_meta=None,
                      apply_router_weight_on_input=False)
        return out

    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True, dynamic=True)
    for m in (4, 5):
        x, w = torch.randn(m, H), torch.rand(m, TOPK)
        ids = torch.stack([torch.randperm(E)[:TOPK] for _ in range(m)]).to(torch.int32)
        out = compiled(torch.empty(m, H), x, w, ids)
        torch.testing.assert_close(out, reference(experts.plain, x, w, ids))
    assert experts.vllm_calls == 0
    assert next(iter(state.counts.values()))["hit"] == 2


@pytest.mark.parametrize("winner,through_op", [("rule", False), ("torch_grouped", True)])
def test_traced_layers_use_the_op_only_if_a_moetune_kernel_can_run(fake_vllm, tmp_path,
                                                                     monkeypatch, winner,
                                                                     through_op):
    """A layer whose winners are all the rule's pick traces as vLLM's own apply (no op)."""
    cls, spec = fake_vllm
    kernel, params = rule_kernel() if winner == "rule" else (winner, {})
    state = PluginState(Settings(table=write_winners(tmp_path / "t.db", SHAPE, (1, 4, 16),
                                                     kernel, params)))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the hook reads it once
    install(state, spec)
    experts, layer = make_layer(cls)
    ops = []
    monkeypatch.setattr(torch.ops.moetune, "experts_apply",
                        lambda *args: ops.append(args[-1]), raising=False)
    out = torch.empty(4, H)
    experts.apply(out, torch.randn(4, H), layer.w13_weight, layer.w2_weight, torch.rand(4, TOPK),
                  torch.zeros(4, TOPK, dtype=torch.int32), experts.moe_config.activation, E, None,
                  None, None, None, None, None, False)
    assert (len(ops), experts.vllm_calls) == ((1, 0) if through_op else (0, 1))


def test_other_vllm_internals_are_refused_before_patching(fake_vllm, table):
    cls, spec = fake_vllm

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids):
        pass

    cls.apply = apply
    with pytest.raises(classes.IncompatibleVllm, match="apply"):
        hook.install(PluginState(Settings(table=table)), (spec,))
    assert cls.apply is apply
    missing = classes.ExpertsSpec("fake_vllm_experts", "Renamed", classes.Held.PLAIN)
    with pytest.raises(classes.IncompatibleVllm, match="not found"):
        hook.install(PluginState(Settings(table=table)), (missing,))


@pytest.fixture
def fresh_plugin(monkeypatch, fake_vllm):
    for name in list(plugin.__dict__):
        if name in ("_STATE", "_REGISTERED"):
            monkeypatch.setattr(plugin, name, None if name == "_STATE" else False)
    monkeypatch.setattr(classes, "platform_specs", lambda: (fake_vllm[1],))
    monkeypatch.setattr(versions, "installed", lambda: "0.32.0")
    for key in ("MOETUNE_MODE", "MOETUNE_TABLE", "MOETUNE_STATS", "MOETUNE_MISSES"):
        monkeypatch.delenv(key, raising=False)
    return fake_vllm[0]


def test_register_is_idempotent_and_counts_are_readable(fresh_plugin, table, monkeypatch):
    monkeypatch.setenv("MOETUNE_TABLE", str(table))
    plugin.register()
    state = plugin._STATE
    plugin.register()
    assert plugin._STATE is state
    experts, layer = make_layer(fresh_plugin)
    call(experts, layer, 4)
    counts = plugin.counters()
    assert counts == {"H=64 I=32 E=4 topk=2 float32 none silu": {"hit": 1, "miss": 0,
                                                                   "fallback": 0}}
    counts["H=64 I=32 E=4 topk=2 float32 none silu"]["hit"] = 99  # a copy
    assert plugin.stats()["counters"] != counts


@pytest.mark.parametrize("mode", ["off", "no-such-mode"])
def test_off_or_unknown_mode_hooks_nothing(fresh_plugin, monkeypatch, mode):
    monkeypatch.setenv("MOETUNE_MODE", mode)
    plugin.register()
    assert plugin._STATE is None and plugin.counters() == {}
    assert not hasattr(fresh_plugin.apply, hook._MARK)


def test_strict_refuses_a_missing_table_at_register(fresh_plugin, monkeypatch, tmp_path):
    monkeypatch.setenv("MOETUNE_MODE", "strict")
    monkeypatch.setenv("MOETUNE_TABLE", str(tmp_path / "missing.db"))
    with pytest.raises(TableError, match="does not exist"):
        plugin.register()


def test_without_moetune_table_the_adopted_table_comes_before_the_shipped_one(
        table, tmp_path, monkeypatch, cpu_sku):
    monkeypatch.setattr(dispatcher_module, "TABLES_DIR", tmp_path / "shipped")
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    assert PluginState(Settings()).dispatcher().path is None  # none shipped, none adopted
    for where in (dispatcher_module.shipped_table(cpu_sku),
                  dispatcher_module.adopted_table(cpu_sku)):
        where.parent.mkdir(parents=True)
        where.write_bytes(table.read_bytes())
        assert Path(PluginState(Settings()).dispatcher().path) == where
    assert Path(PluginState(Settings(table=table)).dispatcher().path) == table


def test_stats_file_is_written_per_process(table, tmp_path):
    state = PluginState(Settings(table=table, stats=str(tmp_path / "s-{pid}.json")))
    state.report()  # nothing ran: no file
    assert not list(tmp_path.glob("s-*.json"))
    state.counter(SHAPE)["hit"] += 3
    state.report()
    (path,) = tmp_path.glob("s-*.json")
    assert json.loads(path.read_text())["counters"] == {
        "H=64 I=32 E=4 topk=2 float32 none silu": {"hit": 3, "miss": 0, "fallback": 0}}



def _count_in_child(state):
    # No torch here: torch's thread pool does not survive fork. Count as the hook does.
    state.counter(SHAPE)["hit"] += 1
    state.hook_exit()


def test_forked_worker_reports_its_own_counters(table, tmp_path):
    """vLLM may fork its workers; a forked multiprocessing child exits through ``os._exit``."""
    import multiprocessing

    state = PluginState(Settings(table=table, stats=str(tmp_path / "s-{pid}.json")))
    state.counter(SHAPE)["hit"] += 5  # the parent's counts must not leak into the child's file
    child = multiprocessing.get_context("fork").Process(target=_count_in_child, args=(state,),
                                                        daemon=True)
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0
    (path,) = tmp_path.glob("s-*.json")
    stats = json.loads(path.read_text())
    assert stats["pid"] == child.pid
    assert stats["counters"] == {"H=64 I=32 E=4 topk=2 float32 none silu":
                                 {"hit": 1, "miss": 0, "fallback": 0}}


def test_unknown_vllm_internals_disable_the_plugin_with_one_warning(fresh_plugin, monkeypatch,
                                                                   caplog, table):
    renamed = classes.ExpertsSpec("fake_vllm_experts", "Renamed", classes.Held.PLAIN)
    monkeypatch.setattr(classes, "platform_specs", lambda: (renamed,))
    monkeypatch.setattr(versions, "installed", lambda: "0.32.7")
    monkeypatch.setenv("MOETUNE_TABLE", str(table))
    plugin.register()
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "vLLM 0.32.7" in warning.getMessage() and "Renamed" in warning.getMessage()
    assert plugin._STATE is None and not hasattr(fresh_plugin.apply, hook._MARK)
    monkeypatch.setattr(plugin, "_REGISTERED", False)
    monkeypatch.setenv("MOETUNE_MODE", "strict")
    with pytest.raises(TableError, match="vLLM 0.32.7 differs"):
        plugin.register()


@pytest.mark.parametrize("found", ["0.31.2", "0.35.0", "1.0.0rc1", "unknown"])
def test_vllm_outside_the_supported_versions_disables_the_plugin(fresh_plugin, monkeypatch,
                                                                 caplog, table, found):
    monkeypatch.setattr(versions, "installed", lambda: found)
    monkeypatch.setenv("MOETUNE_TABLE", str(table))
    plugin.register()
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert found in warning.getMessage() and "0.32, 0.33, 0.34" in warning.getMessage()
    assert plugin._STATE is None and not hasattr(fresh_plugin.apply, hook._MARK)
    monkeypatch.setattr(plugin, "_REGISTERED", False)
    monkeypatch.setenv("MOETUNE_MODE", "strict")
    with pytest.raises(TableError, match=found):
        plugin.register()


def test_batch_invariant_vllm_is_left_alone(fresh_plugin, monkeypatch, caplog, table):
    """Per-bucket winners (and atomics) would make a request's output depend on its batch."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh --vllm)")
    monkeypatch.setenv("MOETUNE_TABLE", str(table))
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    plugin.register()
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "VLLM_BATCH_INVARIANT=1" in warning.getMessage()
    assert plugin._STATE is None and not hasattr(fresh_plugin.apply, hook._MARK)
    monkeypatch.setattr(plugin, "_REGISTERED", False)
    monkeypatch.setenv("MOETUNE_MODE", "strict")
    with pytest.raises(TableError, match="VLLM_BATCH_INVARIANT=1"):
        plugin.register()
    monkeypatch.setattr(plugin, "_REGISTERED", False)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    plugin.register()
    assert plugin._STATE is not None and hasattr(fresh_plugin.apply, hook._MARK)


def test_deterministic_serving_runs_vllms_kernel_where_the_winner_varies(fresh_plugin, table,
                                                                        monkeypatch, caplog):
    """``MOETUNE_DETERMINISTIC=1`` reaches the plans the hooked layers serve from."""
    monkeypatch.setattr(TorchGroupedKernel, "run_to_run",
                        classmethod(lambda cls, problem, params: "adds with atomics"))
    monkeypatch.setenv("MOETUNE_TABLE", str(table))
    monkeypatch.setenv("MOETUNE_DETERMINISTIC", "1")
    caplog.set_level(logging.INFO, logger="moetune")
    plugin.register()
    assert any("deterministic winners only" in r.getMessage() for r in caplog.records)
    experts, layer = make_layer(fresh_plugin)
    call(experts, layer, 4)
    (counts,) = plugin.counters().values()
    assert counts == {"hit": 0, "miss": 0, "fallback": 1}
    monkeypatch.setenv("MOETUNE_DETERMINISTIC", "0")
    assert PluginState(Settings.from_env()).plan(SHAPE, TorchGroupedKernel.layout).choices[
        4].kernel == "torch_grouped"


def test_supported_versions_include_local_and_dev_builds():
    for v in ("0.32.0", "0.32.0+cpu", "0.32.1.dev4+g1234", "0.33.0", "0.34.0", "0.34.2rc1"):
        assert versions.unsupported(v) is None, v
    assert "vllm>=0.32,<0.35" in versions.unsupported("0.35.0")


def test_calls_bound_by_position_run_as_by_keyword(fake_vllm, table):
    cls, spec = fake_vllm
    state = PluginState(Settings(table=table))
    install(state, spec)
    experts, layer = make_layer(cls)
    call(experts, layer, 4, positional=True)
    call(experts, layer, 4)
    assert experts.vllm_calls == 0 and next(iter(state.counts.values()))["hit"] == 2


def test_plan_is_decided_at_attach_and_shared_by_layers_of_a_shape(fake_vllm, tmp_path,
                                                                   monkeypatch, caplog):
    """After attach, a call neither asks the dispatcher nor evaluates the rule."""
    cls, spec = fake_vllm
    table = write_winners(tmp_path / "t.db", SHAPE, (1, 4), *rule_kernel())
    write_winners(table, SHAPE, (16,), "torch_grouped")
    state = PluginState(Settings(table=table))
    install(state, spec)
    caplog.set_level(logging.INFO, logger="moetune")
    (e1, l1), (e2, l2) = make_layer(cls), make_layer(cls)
    first, second = e1.__dict__[hook._ATTR], e2.__dict__[hook._ATTR]
    assert first.plan is second.plan and first.fns is not second.fns

    def forbidden(*args, **kwargs):
        raise AssertionError("the forward pass asked the dispatcher or the rule")

    monkeypatch.setattr(dispatcher_module, "rule_choice", forbidden)
    monkeypatch.setattr(rules, "rule_choice", forbidden)
    monkeypatch.setattr(dispatcher_module, "is_rule_pick", forbidden)
    monkeypatch.setattr(type(state.dispatcher()), "select", forbidden)
    for experts, layer in ((e1, l1), (e2, l2)):
        for m in (1, 3, 16, 40, 3000):
            call(experts, layer, m)
    assert (e1.vllm_calls, e2.vllm_calls) == (2, 2)  # 1 and 3: vLLM's own (the rule's pick)
    (line,) = [r.getMessage() for r in caplog.records if "vLLM holds" in r.getMessage()]
    assert "FakeExperts layers H=64 I=32 E=4 topk=2 float32 none silu" in line
    assert "vLLM holds CPU-prepacked weights, moetune kernels run on a plain copy" in line
    assert "M=1 vLLM, M=4 vLLM, M=16 torch_grouped" in line


def test_op_registry_lets_dropped_layers_go(fake_vllm, table):
    cls, spec = fake_vllm
    state = PluginState(Settings(table=table))
    install(state, spec)
    experts, layer = make_layer(cls)
    op_id = experts.__dict__[hook._ATTR].op_id
    assert op.bound(op_id)
    del experts, layer
    gc.collect()
    assert not op.bound(op_id)


@pytest.fixture
def faulty_table(tmp_path, cpu_sku) -> Path:
    """SHAPE's buckets 1 and 16 tuned; bucket 4 names a kernel this moetune does not have."""
    import sqlite3

    table = write_winners(tmp_path / "t.db", SHAPE, (1, 4, 16), "torch_grouped", sku=cpu_sku)
    with sqlite3.connect(table) as con:
        con.execute("UPDATE winner SET kernel = 'gone_kernel' WHERE bucket_id = "
                    "(SELECT id FROM bucket WHERE num_tokens = 4)")
    return table


def test_faulty_rows_warn_once_per_bucket_and_count_as_fallbacks(fake_vllm, faulty_table,
                                                                 caplog):
    cls, spec = fake_vllm
    state = PluginState(Settings(table=faulty_table))
    install(state, spec)
    (e1, l1), (e2, l2) = make_layer(cls), make_layer(cls)
    for m in (1, 4, 5, 16):
        call(e1, l1, m)
        call(e2, l2, m)
    assert (e1.vllm_calls, e2.vllm_calls) == (2, 2)  # 4 and 5 map to the faulty bucket 4
    assert state.counts == {"H=64 I=32 E=4 topk=2 float32 none silu":
                            {"hit": 4, "miss": 0, "fallback": 4}}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert ("bucket M=4 H=64 I=32 E=4 topk=2 float32 none silu: unknown kernel 'gone_kernel'"
            in warning)


def test_strict_refuses_a_table_with_faulty_rows(fake_vllm, faulty_table):
    state = PluginState(Settings(mode=Mode.STRICT, table=faulty_table))
    with pytest.raises(TableError, match="1 faulty row: .*gone_kernel"):
        state.check_strict()


def test_subclass_calling_the_hooked_apply_runs_vllms_own_not_itself(fake_vllm, table):
    """vLLM subclasses experts classes (its ISA-specific CPU ones, Triton variants); one that
    overrides ``apply`` and calls the hooked one must reach vLLM's original, not recurse."""
    cls, spec = fake_vllm
    state = PluginState(Settings(table=write_winners(table.with_name("rule.db"), SHAPE, (4,),
                                                     *rule_kernel())))
    install(state, spec)

    class Variant(cls):
        def apply(self, *args, **kwargs):
            return super().apply(*args, **kwargs)

    experts, layer = make_layer(Variant)
    call(experts, layer, 4)
    assert experts.vllm_calls == 1
