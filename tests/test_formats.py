"""Foreign formats: vLLM tuned-config JSON and aiter's tuned_fmoe.csv, out of and into tables."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune import db
from moetune.errors import MoetuneError
from moetune.runtime.kernels.base import WeightLayout
from moetune.runtime.kernels.triton_config import SPACE
from moetune.runtime.plan import ShapePlan
from moetune.runtime.problem import MoEProblem
from moetune.tuner import formats_aiter, formats_vllm
from moetune.cli import app
from moetune.tuner.formats_io import Format, detect

H200 = ("nvidia", "H200", "sm_90", 132, 141 << 30)
H200_NVL = ("nvidia", "H200_NVL", "sm_90", 132, 141 << 30)
MI300X = ("amd", "MI300X", "gfx942", 304, 192 << 30)
ENV = {"torch": "2.9.0", "triton": "3.5.0", "cuda": "12.8", "hip": None}
CONFIG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
          "num_warps": 4, "num_stages": 3}
MIXTRAL = {"hidden_size": 4096, "intermediate_size": 14336, "num_experts": 8, "topk": 2}
DSV3 = {"hidden_size": 7168, "intermediate_size": 256, "num_experts": 256, "topk": 8,
        "quant": "fp8_block_128x128"}
AITER_CSV = formats_aiter.installed_csv()
needs_aiter_csv = pytest.mark.skipif(AITER_CSV is None, reason="amd-aiter is not installed")


def write_table(path: Path, winners: list[tuple], env: dict = ENV) -> Path:
    """Winners as (sku, problem, kernel, params, median_us), written through the db API."""
    with db.write_table(path) as table, table.session() as s:
        for sku, problem, kernel, params, median in winners:
            sku_row = db.get_or_create_sku(s, *sku)
            run = db.start_run(s, sku_row, env, "test", None, None)
            bucket = db.get_or_create_bucket(s, **problem.to_row())
            db.set_winner(s, sku_row, bucket, run, kernel, params, median, median * 0.9,
                          median * 1.1, 1e-3, "torch_loop", {}, median * 2)
            db.finish_run(s, run, db.RunStatus.FINISHED)
    return path


def with_tokens(m: int, **shape) -> MoEProblem:
    return MoEProblem(num_tokens=m, **shape)


def split(config: dict, other: dict) -> dict:
    return {**{f"g1_{k}": v for k, v in config.items()}, **{f"g2_{k}": v for k, v in other.items()}}


@pytest.fixture
def triton_table(tmp_path) -> Path:
    big = {**CONFIG, "BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "num_warps": 8}
    return write_table(tmp_path / "t.db", [
        (H200, with_tokens(1, **MIXTRAL), "aiter_triton", CONFIG, 30.0),
        (H200, with_tokens(64, **MIXTRAL), "aiter_triton", big, 80.0),
        (H200, with_tokens(16, **DSV3), "aiter_triton_split", split(CONFIG, big), 50.0),
        (H200, with_tokens(256, **MIXTRAL), "torch_loop", {}, 900.0),
        (H200, with_tokens(4, **{**MIXTRAL, "hidden_size": 2048}), "aiter_triton", CONFIG, 9.0),
    ])


# --- detection --------------------------------------------------------------------------------
def test_detect_tells_the_formats_apart(tmp_path, triton_table):
    (tmp_path / "c.json").write_text("{}")
    (tmp_path / "x.csv").write_text("cu_num,token\n")
    (tmp_path / "junk").write_text("hello")
    assert detect(triton_table) is Format.SQLITE
    assert detect(tmp_path / "c.json") is Format.VLLM
    assert detect(tmp_path) is Format.VLLM
    assert detect(tmp_path / "x.csv") is Format.AITER
    with pytest.raises(MoetuneError, match="cannot tell its format"):
        detect(tmp_path / "junk")
    with pytest.raises(MoetuneError, match="cannot read"):
        detect(tmp_path / "missing")


# --- vLLM -------------------------------------------------------------------------------------
def test_vllm_export_names_and_content_follow_vllm(triton_table, tmp_path):
    out = tmp_path / "configs"
    report = formats_vllm.export_vllm(triton_table, out)
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "E=256,N=256,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json",
        "E=8,N=14336,device_name=NVIDIA_H200.json"]
    mixtral = json.loads((out / names[1]).read_text())
    assert list(mixtral) == ["triton_version", "1", "64"]
    assert mixtral["triton_version"] == "3.5.0"
    assert mixtral["1"] == CONFIG and list(mixtral["64"]) == list(SPACE)
    assert json.loads((out / names[0]).read_text())["16"] == CONFIG  # GEMM1's config
    assert report.written == 3
    assert report.skipped["torch_loop: not a Triton fused-MoE config"] == 1
    assert sum(report.skipped.values()) == 2  # and the H2048 shape that shares Mixtral's file
    assert any("GEMM1" in n and "aiter_triton_split" in n for n in report.notes)


def test_vllm_file_names_match_vllms_own_function(monkeypatch):
    fused_moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")
    monkeypatch.setattr(fused_moe, "get_device_name_as_file_name", lambda: "NVIDIA_H200_NVL")
    cases = [(with_tokens(1, **MIXTRAL), None),
             (with_tokens(1, **DSV3), [128, 128]),
             (with_tokens(1, **{**MIXTRAL, "quant": "fp8_per_channel"}), None),
             (with_tokens(1, **{**MIXTRAL, "dtype": "float32"}), None)]
    dev, _ = formats_vllm.vllm_device_name("nvidia", "H200_NVL")
    for problem, block in cases:
        dtype, ours_block = formats_vllm.selectors(problem)
        assert list(ours_block or []) == (block or [])
        assert formats_vllm.config_file_name(problem.num_experts, problem.intermediate_size,
                                             dev, dtype, ours_block) == \
            fused_moe.get_config_file_name(problem.num_experts, problem.intermediate_size,
                                           dtype, block)


def test_vllm_reads_the_exported_folder(triton_table, tmp_path, monkeypatch):
    fused_moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")
    out = tmp_path / "configs"
    formats_vllm.export_vllm(triton_table, out)
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(out))
    monkeypatch.setattr(fused_moe, "get_device_name_as_file_name", lambda: "NVIDIA_H200")
    configs = fused_moe.get_moe_configs.__wrapped__(8, 14336, None)
    assert configs is not None and configs[1] == CONFIG and set(configs) == {1, 64}


def test_vllm_device_names():
    assert formats_vllm.vllm_device_name("nvidia", "H200_NVL") == ("NVIDIA_H200", False)
    assert formats_vllm.vllm_device_name("amd", "MI300X")[0] == "AMD_Instinct_MI300X"
    assert formats_vllm.vllm_device_name("nvidia", "NEW_GPU") == ("NVIDIA_NEW_GPU", True)


def test_vllm_round_trip_gives_the_same_files(triton_table, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    formats_vllm.export_vllm(triton_table, first)
    hints = formats_vllm.shape_hints(hidden=4096, topk=2)
    report = formats_vllm.import_vllm(first, tmp_path / "imported.db", hints)
    assert report.written == 3 and not report.skipped
    rows = db.read_winners(tmp_path / "imported.db").rows
    assert {r.kernel for r in rows} == {"aiter_triton"}
    assert all(r.median_us is None and r.speedup is None and r.source == "vllm-json"
               for r in rows)
    assert {(r.sku["name"], r.sku["arch"]) for r in rows} == {("H200", "sm_90")}
    formats_vllm.export_vllm(tmp_path / "imported.db", second)
    for path in first.iterdir():
        assert (second / path.name).read_bytes() == path.read_bytes()


def test_vllm_import_into_a_tuned_table_keeps_measured_winners(triton_table, tmp_path):
    folder = tmp_path / "configs"
    formats_vllm.export_vllm(triton_table, folder)
    mixtral = folder / "E=8,N=14336,device_name=NVIDIA_H200.json"
    data = json.loads(mixtral.read_text())
    data["2048"] = {**CONFIG, "BLOCK_SIZE_M": 128}
    mixtral.write_text(json.dumps(data))
    formats_vllm.import_vllm(mixtral, triton_table, formats_vllm.shape_hints(hidden=4096, topk=2))
    snapshot = db.read_winners(triton_table)
    assert len(snapshot.skus) == 1  # the file's H200 is the table's H200
    by_m = {(r.bucket["hidden_size"], r.bucket["num_tokens"]): r for r in snapshot.rows}
    assert by_m[(4096, 1)].median_us == 30.0  # measured beats imported
    assert by_m[(4096, 2048)].source == "vllm-json"  # new bucket added, without a time
    assert by_m[(4096, 2048)].median_us is None


def test_vllm_import_needs_hidden_and_topk():
    with pytest.raises(MoetuneError, match="--hidden and --topk"):
        formats_vllm.shape_hints(hidden=4096)
    hints = formats_vllm.shape_hints("llama-4-maverick")
    assert (hints.hidden_size, hints.topk, hints.router_weight_on_input) == (5120, 1, True)
    assert hints.fp8_scheme.value == "fp8_per_channel"


@pytest.mark.parametrize("name,content,message", [
    ("E=8,N=14336,device_name=NVIDIA_H200.json", "[1, 2]", "not a vLLM tuned config"),
    ("E=8,N=14336,device_name=NVIDIA_H200.json", '{"triton_version": "3.5"}',
     "not a vLLM tuned config"),
    ("E=8,N=14336,device_name=NVIDIA_H200.json", '{"1": {"BLOCK_SIZE_M": 16}}',
     "entry '1' must map a token count"),
    ("E=8,N=14336,device_name=NVIDIA_H200.json", "{not json", "cannot read JSON"),
    ("model.json", json.dumps({"1": CONFIG}), "not a vLLM tuned-config file name"),
])
def test_vllm_bad_input_is_one_clear_error(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    hints = formats_vllm.shape_hints(hidden=4096, topk=2)
    with pytest.raises(MoetuneError, match=message):
        formats_vllm.import_vllm(tmp_path / name, tmp_path / "t.db", hints)
    assert not (tmp_path / "t.db").exists()


# --- aiter ------------------------------------------------------------------------------------
@needs_aiter_csv
def test_aiter_import_of_the_shipped_csv(tmp_path):
    report = formats_aiter.import_aiter(AITER_CSV, tmp_path / "a.db")
    assert report.written + sum(report.skipped.values()) == 773
    assert report.written == 387
    assert report.skipped["time us <= 0 (a corrupt row)"] == 1
    snapshot = db.read_winners(tmp_path / "a.db")
    assert len(snapshot.rows) == 387
    assert {(s["name"], s["arch"], s["compute_units"]) for s in snapshot.skus} == {
        ("MI308X", "gfx942", 80), ("MI355X", "gfx950", 256)}
    row = snapshot.rows[0]
    assert row.kernel == "aiter_fused_moe" and row.params["block_size_M"] in (16, 32, 64, 128)
    assert row.baseline_params == {"block_size_M": 0} and row.baseline_us is None
    assert row.source == "aiter-csv" and row.median_us > 0 and row.speedup is None


@needs_aiter_csv
def test_aiter_round_trip_reproduces_the_rows_aiter_can_look_up(tmp_path):
    formats_aiter.import_aiter(AITER_CSV, tmp_path / "a.db")
    report = formats_aiter.export_aiter(tmp_path / "a.db", tmp_path / "out.csv", AITER_CSV)
    source = {tuple(r[c] for c in formats_aiter.KEY_COLUMNS): r
              for r in formats_aiter.read_csv(AITER_CSV)}
    with open(tmp_path / "out.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == formats_aiter.COLUMNS
        exported = list(reader)
    assert len(exported) == report.written > 380
    for row in exported:
        original = source[tuple(row[c] for c in formats_aiter.KEY_COLUMNS)]
        for column in ("block_m", "ksplit", "kernelName1", "kernelName2", "run_1stage"):
            assert row[column] == original[column]
        assert float(row["us"]) == float(original["us"])


AITER_KEY = ["304", "16", "4096", "512", "64", "8", "ActivationType.Silu", "torch.bfloat16",
             "torch.bfloat16", "torch.bfloat16", "QuantType.No", "1", "0"]


def _aiter_base(tmp_path: Path) -> Path:
    """An aiter CSV with one row, for ``AITER_KEY`` (M=12 and M=16 pad to its token 16)."""
    base = tmp_path / "base.csv"
    base.write_text(",".join(formats_aiter.COLUMNS) + "\n" + ",".join(
        AITER_KEY + ["32", "0", "10.0", "ck2stages_k1", "0.0%", "20.0", "ck2stages_k2", "1.0%",
                     "30.0", "0", "1.0", "2.0"]) + "\n")
    return base


def test_aiter_export_pins_block_m_onto_the_base_rows_kernels(tmp_path):
    problem = with_tokens(12, hidden_size=4096, intermediate_size=512, num_experts=64, topk=8)
    table = write_table(tmp_path / "t.db", [
        (MI300X, problem, "aiter_fused_moe", {"block_size_M": 64}, 40.0),
        (MI300X, problem.with_tokens(16), "aiter_fused_moe", {"block_size_M": 0}, 41.0),
        (MI300X, problem.with_tokens(128), "aiter_fused_moe", {"block_size_M": 32}, 90.0),
        (MI300X, problem.with_tokens(1), "aiter_asm_tkw1", {}, 10.0),
    ])
    base = _aiter_base(tmp_path)
    report = formats_aiter.export_aiter(table, tmp_path / "out.csv", base)
    rows = formats_aiter.read_csv(tmp_path / "out.csv")
    assert len(rows) == report.written == 1
    assert [rows[0][c] for c in formats_aiter.KEY_COLUMNS] == AITER_KEY
    assert (rows[0]["block_m"], rows[0]["kernelName1"], rows[0]["us"]) == ("64", "ck2stages_k1",
                                                                           "40.0")
    assert rows[0]["us1"] == ""  # per-stage numbers are the base's, not moetune's
    assert sum(report.skipped.values()) == 3  # block 0, no base row (M=128), tkw1


def test_aiter_csv_missing_columns_is_one_clear_error(tmp_path):
    bad = tmp_path / "tuned_fmoe.csv"
    bad.write_text("cu_num,token,model_dim,inter_dim\n80,16,4096,512\n")
    with pytest.raises(MoetuneError, match="missing columns expert, topk, act_type"):
        formats_aiter.import_aiter(bad, tmp_path / "t.db")
    assert not (tmp_path / "t.db").exists()


def test_aiter_rows_that_cannot_map_are_counted(tmp_path):
    header = ",".join(formats_aiter.COLUMNS)
    good = ("80,32,4096,512,64,8,ActivationType.Silu,torch.bfloat16,torch.float8_e4m3fnuz,"
            "torch.float8_e4m3fnuz,QuantType.per_Token,1,0,32,0,1,k1,0%,1,k2,0%,12.5,0,1,1")
    rows = [good,
            good.replace("80,32", "999,32"),                      # unknown cu_num
            good.replace("per_Token", "per_1x32"),                # fp4
            good.replace("float8_e4m3fnuz", "float8_e4m3fn"),     # OCP fp8 on gfx942
            good.replace(",1,0,32,", ",0,0,32,")]                 # g1u0
    path = tmp_path / "t.csv"
    path.write_text("\n".join([header] + rows) + "\n")
    report = formats_aiter.import_aiter(path, tmp_path / "t.db")
    assert report.written == 1 and sum(report.skipped.values()) == 4
    row = db.read_winners(tmp_path / "t.db").rows[0]
    assert row.bucket["quant"] == "fp8_per_channel" and row.median_us == 12.5


# --- the CLI ----------------------------------------------------------------------------------
def test_cli_export_and_import_round_trip(triton_table, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["export", str(triton_table), "--format", "vllm",
                                 "--output", str(tmp_path / "cfg")])
    assert result.exit_code == 0, result.output
    assert "exported 3 rows" in result.output and "torch_loop" in result.output
    result = runner.invoke(app, ["import", str(tmp_path / "cfg"), "--output",
                                 str(tmp_path / "i.db"), "--hidden", "4096", "--topk", "2"])
    assert result.exit_code == 0, result.output
    assert len(db.read_winners(tmp_path / "i.db").rows) == 3


@pytest.mark.parametrize("content,message", [
    ("cu_num,token\n80,16\n", "missing columns"),
    ('{"oops": true}', "not a vLLM tuned config"),
])
def test_cli_bad_import_is_one_error_line(tmp_path, content, message):
    path = tmp_path / ("tuned_fmoe.csv" if content.startswith("cu") else
                       "E=8,N=14336,device_name=NVIDIA_H200.json")
    path.write_text(content)
    result = CliRunner().invoke(app, ["import", str(path), "--output", str(tmp_path / "t.db"),
                                      "--hidden", "4096", "--topk", "2"])
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output


def test_imported_vllm_rows_show_no_invented_times(tmp_path):
    """What vLLM files lack (times, a measured baseline) reads as missing, not as numbers."""
    from moetune.runtime.dispatcher import Dispatcher
    from moetune.runtime.platform import SKU, Vendor
    from moetune.runtime.vllm.configs import shipped_folder
    from moetune.tuner import report

    folder = shipped_folder()
    if folder is None:
        pytest.skip("vLLM is not installed (its tuned files are the input here)")
    table = tmp_path / "vllm.db"
    formats_vllm.import_vllm(folder / "E=8,N=14336,device_name=NVIDIA_H200.json", table,
                             formats_vllm.shape_hints(preset_name="mixtral-8x7b"))
    shown = CliRunner().invoke(app, ["show", str(table)])
    assert shown.exit_code == 0 and "1000000000" not in shown.output and " - " in shown.output
    h200 = SKU(Vendor.NVIDIA, "H200", "sm_90", 132, 141 << 30)
    dispatcher = Dispatcher.load(table, h200, check_environment=False)
    problem = MoEProblem(100, 4096, 14336, 8, 2)
    pick = dispatcher.select(problem)
    assert pick.source == "table" and pick.median_us is None  # imported rows still serve
    plan = ShapePlan.build(dispatcher, problem.shape, WeightLayout.PLAIN)
    assert "imported: no speedup measured" in report.lookup_text(problem, dispatcher, plan)


# --- invalid rows: the dispatcher's check, with the reason `show` gives --------------------------
def _break_params(table: Path, num_tokens: int) -> None:
    import sqlite3

    with sqlite3.connect(table) as con:
        con.execute("UPDATE winner SET params = '{not json' WHERE bucket_id = "
                    "(SELECT id FROM bucket WHERE num_tokens = ?)", (num_tokens,))


def _show_reasons(table: Path, sku: tuple) -> dict[str, str]:
    """``moetune show --json``'s reason per row, on a device of ``sku``."""
    from moetune.runtime.platform import SKU, Vendor
    from moetune.tuner import report

    here = SKU(Vendor(sku[0]), *sku[1:])
    return {str(r.get("num_tokens", r.get("bad_row"))): r["served_reason"]
            for r in report.winner_dicts(db.read_winners(table), here)}


def test_vllm_export_skips_invalid_rows_with_the_reason_show_gives(tmp_path):
    table = write_table(tmp_path / "t.db", [
        (H200, with_tokens(1, **MIXTRAL), "aiter_triton", CONFIG, 30.0),
        (H200, with_tokens(8, **MIXTRAL), "foo", CONFIG, 20.0),  # a Triton config, no kernel
        (H200, with_tokens(16, **MIXTRAL), "foo", {}, 20.0),
        (H200, with_tokens(32, **MIXTRAL), "aiter_triton", {**CONFIG, "BLOCK_SIZE_M": 7}, 40.0),
        (H200, with_tokens(64, **MIXTRAL), "aiter_triton", CONFIG, 50.0),
    ])
    _break_params(table, 64)
    shown = _show_reasons(table, H200)
    report = formats_vllm.export_vllm(table, tmp_path / "cfg")
    assert report.written == 1
    [path] = report.outputs
    assert list(json.loads(path.read_text())) == ["triton_version", "1"]
    assert report.skipped[shown["8"]] == 2 and shown["8"] == shown["16"] == "unknown kernel 'foo'"
    assert report.skipped[shown["32"]] == 1
    assert shown["32"] == "invalid params: aiter_triton: BLOCK_SIZE_M=7 not in " \
                          "[16, 32, 64, 128, 256, 8]"
    [unreadable] = [k for k in shown if k not in ("1", "8", "16", "32")]
    [reason] = [k for k in report.skipped if k.startswith("params are not a JSON object")]
    assert shown[unreadable].endswith(reason)  # show prefixes the row's id and bucket
    assert sum(report.skipped.values()) == 4
    assert not any("not a Triton fused-MoE config" in k for k in report.skipped)


def test_aiter_export_skips_invalid_rows_with_the_reason_show_gives(tmp_path):
    problem = with_tokens(12, hidden_size=4096, intermediate_size=512, num_experts=64, topk=8)
    table = write_table(tmp_path / "t.db", [
        (MI300X, problem, "aiter_fused_moe", {"block_size_M": 64}, 40.0),
        (MI300X, problem.with_tokens(16), "aiter_fused_moe", {"block_size_M": 7}, 41.0),
        (MI300X, problem.with_tokens(13), "foo", {"block_size_M": 32}, 39.0),
    ])
    shown = _show_reasons(table, MI300X)
    report = formats_aiter.export_aiter(table, tmp_path / "out.csv", _aiter_base(tmp_path))
    [row] = formats_aiter.read_csv(tmp_path / "out.csv")
    assert (row["block_m"], row["us"]) == ("64", "40.0") and report.written == 1
    assert dict(report.skipped) == {"unknown kernel 'foo'": 1, shown["16"]: 1}
    assert shown["13"] == "unknown kernel 'foo'"
    assert shown["16"].startswith("invalid params: aiter_fused_moe: block_size_M=7 not in")


def test_vllm_import_refuses_configs_outside_the_space_with_the_reason(tmp_path):
    source = tmp_path / "E=8,N=14336,device_name=NVIDIA_H200.json"
    source.write_text(json.dumps({"1": CONFIG, "2": {**CONFIG, "BLOCK_SIZE_M": 7}}))
    hints = formats_vllm.shape_hints(hidden=4096, topk=2)
    report = formats_vllm.import_vllm(source, tmp_path / "t.db", hints)
    assert report.written == 1
    assert dict(report.skipped) == {
        "invalid params: aiter_triton: BLOCK_SIZE_M=7 not in [16, 32, 64, 128, 256, 8]": 1}
    assert [r.bucket["num_tokens"] for r in db.read_winners(tmp_path / "t.db").rows] == [1]


def test_an_import_with_no_valid_row_leaves_the_table_untouched(tmp_path, triton_table):
    source = tmp_path / "E=8,N=14336,device_name=NVIDIA_H200.json"
    source.write_text(json.dumps({"2": {**CONFIG, "num_warps": 3}}))
    before = triton_table.read_bytes()
    hints = formats_vllm.shape_hints(hidden=4096, topk=2)
    with pytest.raises(MoetuneError, match="nothing to import(.|\n)*invalid params: "
                                           "aiter_triton: num_warps=3"):
        formats_vllm.import_vllm(source, triton_table, hints)
    assert triton_table.read_bytes() == before


def test_an_import_into_a_table_drops_its_invalid_rows_and_says_so(tmp_path):
    table = write_table(tmp_path / "t.db", [
        (H200, with_tokens(8, **MIXTRAL), "foo", CONFIG, 20.0),
        (H200, with_tokens(16, **MIXTRAL), "torch_loop", {}, 20.0),
    ])
    source = tmp_path / "E=8,N=14336,device_name=NVIDIA_H200.json"
    source.write_text(json.dumps({"1": CONFIG}))
    report = formats_vllm.import_vllm(source, table, formats_vllm.shape_hints(hidden=4096,
                                                                              topk=2))
    rows = {r.bucket["num_tokens"]: r.kernel for r in db.read_winners(table).rows}
    assert rows == {1: "aiter_triton", 16: "torch_loop"}
    [dropped] = [n for n in report.notes if n.startswith("dropped")]
    assert "num_tokens=8 " in dropped and dropped.endswith(f"from {table}: unknown kernel 'foo'")
