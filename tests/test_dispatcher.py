"""The dispatcher: table hits, nearest buckets within a shape, and never crashing on a table."""

import dataclasses
import importlib.util
import sqlite3
from pathlib import Path

import pytest

from moetune.db import read_winners
from moetune.runtime.dispatcher import Dispatcher
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import MoEProblem
from moetune.runtime.registry import default_registry
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
    assert Dispatcher.load(path, cpu_sku, check_environment=False).status.usable


def _shipped_h200() -> tuple[Path, SKU]:
    import moetune.runtime

    return (Path(moetune.runtime.__file__).parent / "tables" / "nvidia_H200.db",
            SKU(Vendor.NVIDIA, "H200", "sm_90", 132, 141 << 30))


def test_shipped_h200_table_serves_mixtral_and_deepseek_where_its_baseline_is_the_rule(
        monkeypatch):
    """Tuned on an H200 without vLLM's tuned files, against vLLM's default config: where that
    is the rule (no vLLM files here), every row serves."""
    from moetune.runtime import vllm_configs

    monkeypatch.setattr(vllm_configs, "shipped_folder", lambda: None)
    shipped, h200 = _shipped_h200()
    d = Dispatcher.load(shipped, h200, check_environment=False)  # measured under CUDA 13
    assert d.status.usable and d.status.rows >= 24 and not d.status.rejected_rows
    aiter_triton = {"aiter_triton", "aiter_triton_silu_fused", "aiter_triton_silu_fused_persistent"}
    for name in ("mixtral-8x7b", "deepseek-v3"):  # every tuned bucket of both, 4096 included
        shape = preset(name).shape
        picks = [d.select(shape.problem(m)) for m in (1, 300, 4096, 5000)]
        assert all(s.source == "table" and s.kernel in aiter_triton for s in picks), picks
    # The table's winners are registered kernels that a layer of that bucket may run.
    assert all(default_registry.get(r.kernel).supports(MoEProblem.from_row(r.bucket), h200)[0]
               for r in read_winners(shipped).rows)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_tuned_rows_are_not_used_where_the_rule_is_no_longer_their_baseline():
    """vLLM ships tuned H200 files for both shapes: its rule is then that file's config, and
    a row timed against the default config proves nothing against it."""
    shipped, h200 = _shipped_h200()
    d = Dispatcher.load(shipped, h200, check_environment=False)
    assert d.status.usable and d.status.rows == 0 and len(d.status.rejected_rows) >= 24
    assert all("re-tune this bucket" in r for r in d.status.rejected_rows)
    pick = d.select(preset("mixtral-8x7b").shape.problem(64))
    assert pick.source == "rule" and "E=8,N=14336,device_name=NVIDIA_H200.json" in pick.reason