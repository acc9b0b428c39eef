"""The dispatcher: table hits, nearest buckets within a shape, and never crashing on a table."""

import dataclasses
import json
import importlib.util
import sqlite3
from pathlib import Path

import pytest

from moetune.runtime.dispatcher import Dispatcher
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.vllm.configs import vllm_default_config
from moetune.runtime.problem import DEFAULT_BUCKETS
from moetune.runtime.registry import default_registry
from moetune.runtime.rules import rule_choice
from moetune.tuner.presets import preset

TINY = preset("tiny").shape


def test_hits_use_the_nearest_tuned_bucket_of_the_same_shape(tiny_table, cpu_sku):
    d = Dispatcher.load(tiny_table, cpu_sku)
    assert d.status.usable and d.status.rows == 3
    for m, bucket in ((1, 1), (7, 1), (9, 16), (40, 16), (41, 64), (100000, 64)):
        s = d.select(TINY.problem(m))
        assert (s.source, s.bucket) == ("table", bucket), m
    assert d.select(TINY.problem(7)) is d.select(TINY.problem(7))  # memoized


def test_other_shapes_never_borrow_buckets(tiny_table, cpu_sku):
    d = Dispatcher.load(tiny_table, cpu_sku)
    for change in (dict(hidden_size=256), dict(num_experts=16), dict(topk=1),
                   dict(dtype="float32"), dict(activation="gelu")):
        s = d.select(dataclasses.replace(TINY, **change).problem(16))
        assert s.source == "rule" and "shape not in table" in s.reason


def test_table_for_another_sku_is_ignored_with_the_reason(tiny_table):
    h200 = SKU(Vendor.NVIDIA, "H200", "sm_90", 132, 141 << 30)
    d = Dispatcher.load(tiny_table, h200)
    assert not d.status.usable and "nvidia:H200" in d.status.reason
    s = d.select(TINY.problem(16))
    assert s.source == "rule" and "table not used" in s.reason


def test_corrupt_missing_and_truncated_tables_fall_back(tiny_table, tmp_path, cpu_sku):
    garbage = tmp_path / "g.db"
    garbage.write_bytes(b"\x00junk" * 1000)
    truncated = tmp_path / "t.db"
    truncated.write_bytes(tiny_table.read_bytes()[:4096])
    for path in (garbage, truncated, tmp_path / "missing.db"):
        d = Dispatcher.load(path, cpu_sku)
        assert not d.status.usable and str(path) in d.status.reason
        assert d.select(TINY.problem(4)).source == "rule"


def test_rows_with_unknown_kernels_or_bad_params_are_rejected_not_fatal(tiny_table, tmp_path,
                                                                       cpu_sku):
    path = tmp_path / "edited.db"
    path.write_bytes(tiny_table.read_bytes())
    with sqlite3.connect(path) as con:
        ids = [r[0] for r in con.execute(
            "SELECT w.id FROM winner w JOIN bucket b ON b.id = w.bucket_id ORDER BY b.num_tokens")]
        con.execute("UPDATE winner SET kernel = 'gone_kernel' WHERE id = ?", (ids[0],))
        con.execute("UPDATE winner SET kernel = 'torch_dense', params = '{\"chunk_tokens\": 3}' "
                    "WHERE id = ?", (ids[1],))
    d = Dispatcher.load(path, cpu_sku)
    assert d.status.usable and d.status.rows == 1 and len(d.status.rejected_rows) == 2
    assert any("gone_kernel" in r for r in d.status.rejected_rows)
    assert d.select(TINY.problem(1)).bucket == 64  # the one valid row serves the shape
    assert d.status.faulty_rows == d.status.rejected_rows
    faults = d.faults(TINY)
    assert sorted(faults) == [1, 16]
    assert "unknown kernel 'gone_kernel'" in faults[1] and "invalid params" in faults[16]


def test_unreadable_params_are_faults_of_their_bucket_and_stale_rows_are_not(tiny_table,
                                                                             tmp_path, cpu_sku):
    path = tmp_path / "edited.db"
    path.write_bytes(tiny_table.read_bytes())
    with sqlite3.connect(path) as con:
        con.execute("UPDATE winner SET params = '{not json' WHERE bucket_id = "
                    "(SELECT id FROM bucket WHERE num_tokens = 16)")
        con.execute("UPDATE winner SET baselines = NULL, source = 'measured', baseline_kernel = "
                    "'torch_dense', baseline_params = '{\"chunk_tokens\": 8}' WHERE bucket_id = "
                    "(SELECT id FROM bucket WHERE num_tokens = 64)")
    d = Dispatcher.load(path, cpu_sku)
    assert d.buckets(TINY) == (1,)
    assert len(d.status.rejected_rows) == 2 and len(d.status.faulty_rows) == 1
    assert list(d.faults(TINY)) == [16] and "not a JSON object" in d.faults(TINY)[16]


def test_table_from_another_environment_is_ignored(tiny_table, tmp_path, cpu_sku):
    path = tmp_path / "old.db"
    path.write_bytes(tiny_table.read_bytes())
    with sqlite3.connect(path) as con:
        con.execute("""UPDATE tuning_run SET environment = json_set(environment, '$.torch',
                       '1.13.1')""")
    d = Dispatcher.load(path, cpu_sku)
    assert not d.status.usable and "torch 1.13 (table)" in d.status.reason
    assert "moetune tune --reconfirm" in d.status.reason  # what to do about it
    assert Dispatcher.load(path, cpu_sku, check_environment=False).status.usable


def _split_runs(table: Path, path: Path, older: str) -> None:
    """``table`` copied to ``path`` as two runs: bucket 64's row stays with run 1, measured
    under torch ``older``; the others move to run 2, a day newer, in this environment."""
    path.write_bytes(table.read_bytes())
    with sqlite3.connect(path) as con:
        con.execute("""INSERT INTO tuning_run (id, sku_id, moetune_version, "commit",
                       environment, driver, host, pid, command, ceilings, started_at,
                       finished_at, status)
                       SELECT 2, sku_id, moetune_version, "commit", environment, driver, host,
                       pid, command, ceilings, datetime(started_at, '+1 day'), finished_at,
                       status FROM tuning_run WHERE id = 1""")
        con.execute("UPDATE winner SET run_id = 2 WHERE bucket_id IN "
                    "(SELECT id FROM bucket WHERE num_tokens != 64)")
        con.execute("UPDATE tuning_run SET environment = json_set(environment, '$.torch', ?) "
                    "WHERE id = 1", (older,))


def test_rows_measured_in_another_environment_are_stale_though_the_newest_run_matches(
        tiny_table, tmp_path, cpu_sku):
    """A table merged from runs under different versions (or re-tuned into a copy of a
    shipped table) is checked row by row: the newest run matching this environment does not
    vouch for an older run's rows, which are refused, naming the versions, not faulty."""
    path = tmp_path / "mixed.db"
    _split_runs(tiny_table, path, "1.13.1")
    d = Dispatcher.load(path, cpu_sku)
    assert d.status.usable and d.buckets(TINY) == (1, 16)
    assert d.select(TINY.problem(64)).bucket == 16  # the nearest row served here
    (line,) = d.status.rejected_rows
    assert "bucket M=64 " in line and "measured in another environment" in line
    assert "torch 1.13 (table)" in line and not d.status.faulty_rows
    assert Dispatcher.load(path, cpu_sku, check_environment=False).buckets(TINY) == (1, 16, 64)


def _shipped_h200() -> tuple[Path, SKU]:
    import moetune.runtime

    return (Path(moetune.runtime.__file__).parent / "tables" / "nvidia_H200.db",
            SKU(Vendor.NVIDIA, "H200", "sm_90", 132, 141 << 30))


SHIPPED_PRESETS = ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3",
                   "llama-4-maverick")


def _assert_serves_every_preset_bucket(d: Dispatcher, sku: SKU,
                                       presets: tuple[str, ...] = SHIPPED_PRESETS) -> None:
    """Every bucket of ``presets`` comes from the table (no row refused), at its own bucket,
    as a kernel eligible on ``sku`` with parameters inside its space."""
    assert d.status.usable and d.status.rows == 18 * len(presets) and not d.status.rejected_rows
    for name in presets:
        shape = preset(name).shape
        assert d.buckets(shape) == DEFAULT_BUCKETS, name
        for m in DEFAULT_BUCKETS:
            pick = d.select(shape.problem(m))
            assert pick.source == "table" and pick.bucket == m, (name, m, pick)
            kernel = default_registry.get(pick.kernel)
            assert kernel.supports(shape.problem(m), sku)[0]
            assert kernel.validate(pick.params) == pick.params


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_shipped_h200_table_serves_every_preset_bucket_with_vllms_configs_as_the_rule(monkeypatch):
    """Tuned on the H200 against vLLM's own tuned files (the configs folder vLLM ships): with
    them as the rule, every bucket of the five presets is served from the table, and where
    the winner did not beat vLLM's pick, that pick is what runs."""
    from moetune.runtime.vllm import configs as vllm_configs

    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(vllm_configs.shipped_folder()))
    shipped, h200 = _shipped_h200()
    d = Dispatcher.load(shipped, h200, check_environment=False)  # measured under CUDA 13
    _assert_serves_every_preset_bucket(d, h200)
    rule = rule_choice(preset("mixtral-8x7b").shape.problem(64), h200)
    assert "E=8,N=14336,device_name=NVIDIA_H200.json" in rule.reason


def test_shipped_h200_table_also_serves_where_vllm_has_no_tuned_file(monkeypatch):
    """The same rows were timed against vLLM's default config too: a vLLM without tuned
    files (rule = its default config) is served by the same table."""
    from moetune.runtime.vllm import configs as vllm_configs

    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    monkeypatch.setattr(vllm_configs, "shipped_folder", lambda: None)
    shipped, h200 = _shipped_h200()
    d = Dispatcher.load(shipped, h200, check_environment=False)
    _assert_serves_every_preset_bucket(d, h200)
    assert "default config" in rule_choice(preset("qwen3-30b-a3b").shape.problem(64), h200).reason


H100 = SKU(Vendor.NVIDIA, "H100_80GB_HBM3", "sm_90", 132, 85017493504)
H100_PRESETS = SHIPPED_PRESETS


#: Re-confirmed against vLLM 0.34's own path on an H100 (2026-12-07), these buckets' winners no
#: longer beat it: they went back to vLLM's pick, timed against vLLM 0.34 alone.
H100_BACK_TO_VLLM = {("deepseek-v3", 24), ("deepseek-v3", 48), ("deepseek-v3", 64)}


def _h100_table() -> Dispatcher:
    import moetune.runtime
    from moetune.runtime.dispatcher import shipped_table

    path = shipped_table(H100)
    assert path == Path(moetune.runtime.__file__).parent / "tables" / "nvidia_H100_80GB_HBM3.db"
    return Dispatcher.load(path, H100, check_environment=False)


def _assert_other_shapes_run_the_rule(d: Dispatcher) -> None:
    mixtral = preset("mixtral-8x7b").shape
    assert {d.select(mixtral.problem(m)).kernel for m in (512, 4096)} == {"moetune_grouped_mm"}
    mixtral_tp2 = dataclasses.replace(mixtral, intermediate_size=7168).problem(64)
    other, rule = d.select(mixtral_tp2), rule_choice(mixtral_tp2, H100)
    assert other.source != "table" and (other.kernel, other.params) == (rule.kernel, rule.params)


def _as_vllm_034_on_cuda(monkeypatch) -> None:
    """The rule as a CUDA host with vLLM 0.34 has it: vLLM's own path (``vllm_triton``)."""
    from moetune.runtime import rules
    from moetune.runtime.kernels.vllm_triton import VllmTritonKernel

    monkeypatch.setattr(VllmTritonKernel, "_supports_device",
                        classmethod(lambda cls, problem, sku: None))
    monkeypatch.setattr(rules, "installed", lambda: "0.34.0")


def test_shipped_h100_table_serves_every_bucket_where_the_rule_is_vllm_034s_path(monkeypatch):
    """Re-confirmed on an H100 against vLLM 0.34's own path: where that is the rule, every
    bucket of the five presets is served from the table, and the three whose winner no longer
    beat vLLM run vLLM's pick; a shape without rows runs vLLM's pick too."""
    _as_vllm_034_on_cuda(monkeypatch)
    d = _h100_table()
    _assert_serves_every_preset_bucket(d, H100, H100_PRESETS)
    assert {(name, m) for name in H100_PRESETS for m in DEFAULT_BUCKETS
            if d.select(preset(name).shape.problem(m)).rule_pick} == H100_BACK_TO_VLLM
    assert rule_choice(preset("deepseek-v3").shape.problem(64), H100).kernel == "vllm_triton"
    _assert_other_shapes_run_the_rule(d)


def test_a_vllm_033_host_is_not_served_rows_confirmed_against_vllm_034(monkeypatch):
    """vLLM 0.33's own path is another baseline: none of the rows was timed against it."""
    _as_vllm_034_on_cuda(monkeypatch)
    from moetune.runtime import rules

    monkeypatch.setattr(rules, "installed", lambda: "0.33.1")
    d = _h100_table()
    assert len(d.status.rejected_rows) == 90
    assert all("vLLM 0.34's pick, the rule here is vLLM 0.33's" in line
               for line in d.status.rejected_rows)


def test_shipped_h100_table_keeps_serving_where_vllms_path_is_emulated(monkeypatch):
    """Without vLLM's CUDA path (the rule: its emulation, with vLLM's default config), the
    rows whose winner stood keep the emulation's variants measured earlier and are served; the
    three that went back to vLLM's pick were timed against vLLM 0.34 alone and are stale (their
    calls take the nearest served bucket's row)."""
    from moetune.runtime.vllm import configs as vllm_configs

    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    monkeypatch.setattr(vllm_configs, "shipped_folder", lambda: None)  # rule: default config
    d = _h100_table()
    assert d.status.rows == 87 and len(d.status.rejected_rows) == len(H100_BACK_TO_VLLM)
    for name in H100_PRESETS:
        for m in DEFAULT_BUCKETS:
            pick = d.select(preset(name).shape.problem(m))
            # a bucket without a usable row takes its nearest neighbour's, as any table's
            assert pick.source == "table" and (pick.bucket == m) == (
                (name, m) not in H100_BACK_TO_VLLM), (name, m)
    _assert_other_shapes_run_the_rule(d)


def test_rows_timed_against_another_vllms_pick_are_stale_naming_both(tiny_table, cpu_sku,
                                                                     monkeypatch):
    """The CPU rule is the installed vLLM's kernel: a row timed against it under another vLLM
    minor release proves nothing about this one's, and the reason says re-confirm; a patch
    release picks the same, so its rows serve."""
    from moetune.db import minor_version, read_winners
    from moetune.runtime import rules
    from moetune.runtime.dispatcher import row_verdict

    rows = read_winners(tiny_table).rows
    rule = rule_choice(preset("tiny").shape.problem(1), cpu_sku)
    if rule.vllm is None:
        pytest.skip(f"the CPU rule here is no vLLM's pick ({rule.reason})")
    timed = minor_version(rule.vllm)
    assert all(r.tuned_against.vllm == rule.vllm for r in rows)
    monkeypatch.setattr(rules, "installed", lambda: f"{timed}.99")
    assert all(row_verdict(r, cpu_sku).selection is not None for r in rows)
    monkeypatch.setattr(rules, "installed", lambda: "0.99.0")
    for row in rows:
        verdict = row_verdict(row, cpu_sku)
        assert verdict.stale and verdict.reason == (
            f"stale: timed against vLLM {timed}'s pick, the rule here is vLLM 0.99's: "
            "re-confirm (tune --reconfirm)")


def test_rows_are_stale_where_todays_rule_is_not_among_their_baselines(monkeypatch, tmp_path):
    """A row that was never timed against the rule here proves nothing against it: not served,
    the reason says re-tune; one whose winner lost to today's rule serves the rule's pick."""
    from moetune.runtime.vllm import configs as vllm_configs

    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    monkeypatch.setattr(vllm_configs, "shipped_folder", lambda: None)  # rule: default config
    shipped, h200 = _shipped_h200()
    path = tmp_path / "h200.db"
    path.write_bytes(shipped.read_bytes())
    mixtral = ("(SELECT id FROM bucket WHERE hidden_size = 4096 AND intermediate_size = 14336 "
               "AND num_tokens = {})")
    with sqlite3.connect(path) as con:
        for m in (64, 128):
            variants = json.loads(con.execute(
                f"SELECT baselines FROM winner WHERE bucket_id = {mixtral.format(m)}"
            ).fetchone()[0])["variants"]
            default = [v for v in variants if v["params"] == vllm_default_config(
                preset("mixtral-8x7b").shape.problem(m))]
            assert len(default) == 1
            if m == 64:  # never timed against the default config
                variants.remove(default[0])
            else:  # timed, and the winner did not beat it
                default[0]["beaten"] = False
            con.execute("UPDATE winner SET baselines = ? WHERE bucket_id = "
                        f"{mixtral.format(m)}", (json.dumps({"variants": variants}),))
    d = Dispatcher.load(path, h200, check_environment=False)
    shape = preset("mixtral-8x7b").shape
    assert len(d.status.rejected_rows) == 1 and "re-tune this bucket" in d.status.rejected_rows[0]
    assert 64 not in d.buckets(shape)
    kept = d.select(shape.problem(128))
    rule = rule_choice(shape.problem(128), h200)
    assert kept.source == "table" and kept.rule_pick
    assert (kept.kernel, kept.params) == (rule.kernel, rule.params)
