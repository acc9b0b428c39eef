"""The `moetune` command line, run in-process through typer's runner on real tables."""

import dataclasses
import json
import shutil

import pytest
from typer.testing import CliRunner

from moetune import db
from moetune.runtime.platform import detect_sku, environment
from moetune.runtime.rules import rule_choice
from moetune.tuner.presets import preset
from moetune.cli import app
from moetune.tuner.job import JobOptions, run_job

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_help_lists_every_command():
    result = invoke("--help")
    assert result.exit_code == 0
    for cmd in ("tune", "adopt", "show", "lookup", "export", "import", "merge", "doctor"):
        assert cmd in result.output


def test_tune_tiny_writes_a_table_with_a_gated_winner_per_bucket(tmp_path):
    path = tmp_path / "t.db"
    result = invoke("tune", "--preset", "tiny", "--device", "cpu", "--output", path,
                    "--buckets", "1,16", "--trials", "5")
    assert result.exit_code == 0, result.output
    rows = db.read_winners(path).rows
    assert sorted(r.bucket["num_tokens"] for r in rows) == [1, 16]
    assert all(r.error <= 2.5e-2 and r.baseline_us > 0 and r.speedup > 0 for r in rows)


def test_tune_reconfirm_without_a_shape_re_times_every_bucket_of_the_table(tiny_table,
                                                                              tmp_path):
    path = tmp_path / "t.db"
    path.write_bytes(tiny_table.read_bytes())
    result = invoke("tune", "--reconfirm", "--device", "cpu", "--output", path, "--reps", 2)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("M=")]
    assert [line.split()[0] for line in lines] == ["M=1", "M=16", "M=64"]
    assert all("s winner re-timed, no search" in line for line in lines), lines
    assert {r.run_id for r in db.read_winners(path).rows} == {2}
    one = invoke("tune", "--reconfirm", "--device", "cpu", "--output", path, "--reps", 2,
                 "--buckets", "16,2048")  # of the table's buckets, those listed
    assert [line.split()[0] for line in one.output.splitlines() if line.startswith("M=")] \
        == ["M=16"]
    missing = invoke("tune", "--reconfirm", "--device", "cpu", "--output", tmp_path / "no.db")
    assert missing.exit_code == 1 and "no such table to re-confirm" in missing.output
    assert not (tmp_path / "no.db").exists()


def test_tunes_closing_table_marks_served_what_serving_here_runs(tiny_table, tmp_path,
                                                                 monkeypatch):
    """The table `tune` (and `adopt`) prints at its end answers "served here" under the
    serving settings here, as `show` does."""
    path = tmp_path / "t.db"
    path.write_bytes(tiny_table.read_bytes())
    for name in ("MOETUNE_MODE", "MOETUNE_DETERMINISTIC", "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    args = ("tune", "--reconfirm", "--device", "cpu", "--output", path, "--reps", 2)
    assert "no: moetune hooks no layer" not in invoke(*args).output
    monkeypatch.setenv("MOETUNE_MODE", "off")
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert result.output.count("no: moetune hooks no layer: MOETUNE_MODE=off") == 3


def test_show_prints_grid_and_json(tiny_table):
    grid = invoke("show", tiny_table)
    assert grid.exit_code == 0 and "H128 I256 E8" in grid.output and "speedup" in grid.output
    lines = invoke("show", tiny_table, "--json").output.strip().splitlines()
    rows = [json.loads(line) for line in lines]
    assert sorted(r["num_tokens"] for r in rows) == [1, 16, 64]
    assert {"kernel", "params", "median_us", "baseline_us", "speedup", "error"} <= set(rows[0])
    rule = rule_choice(preset("tiny").shape.problem(1), detect_sku("cpu"))
    assert {r["baseline_vllm"] for r in rows} == {rule.vllm}  # whose pick the speedup is over
    assert "over vLLM" in grid.output and (rule.vllm or "-") in grid.output


def test_show_says_no_row_is_served_where_the_plugin_hooks_nothing(tiny_table, monkeypatch):
    """MOETUNE_MODE=off, a batch-invariant vLLM or a release the plugin does not serve: vLLM's
    own kernel runs for every row, and show says why, as lookup does."""
    from moetune.runtime.vllm import versions

    def shown() -> list[dict]:
        result = invoke("show", tiny_table, "--json", "--device", "cpu")
        assert result.exit_code == 0, result.output
        return [json.loads(line) for line in result.output.strip().splitlines()]

    for name in ("MOETUNE_MODE", "MOETUNE_DETERMINISTIC", "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    assert all(r["served"] for r in shown())  # tuned here, against the rule here
    assert "no:" not in invoke("show", tiny_table, "--device", "cpu").output
    monkeypatch.setenv("MOETUNE_MODE", "off")
    assert {(r["served"], r["served_reason"]) for r in shown()} == {
        (False, "moetune hooks no layer: MOETUNE_MODE=off")}
    grid = invoke("show", tiny_table, "--device", "cpu").output
    assert grid.count("no: moetune hooks no layer: MOETUNE_MODE=off") == 3 and "yes" not in grid
    monkeypatch.delenv("MOETUNE_MODE")
    with monkeypatch.context() as m:
        m.setattr(versions, "installed", lambda: "0.35.0")  # a release it does not serve
        assert all(not r["served"] and "vLLM 0.35.0 is outside" in r["served_reason"]
                   for r in shown())
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh --vllm)")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert all(not r["served"] and "VLLM_BATCH_INVARIANT=1" in r["served_reason"]
               for r in shown())


def test_lookup_tuned_and_untuned_shapes(tiny_table):
    tuned = invoke("lookup", "--table", tiny_table, "--preset", "tiny", "--num-tokens", 7,
                   "--device", "cpu")
    assert tuned.exit_code == 0, tuned.output
    assert "source:  table" in tuned.output and "bucket M=1" in tuned.output
    # What serving does before a moetune kernel where the installed vLLM routes padding rows
    # nowhere (vLLM's own kernel skips them itself).
    from moetune.runtime.vllm import versions

    facts = versions.facts_of(versions.installed())
    moetune_kernel = "pick:    vLLM's own kernel" not in tuned.output
    padding = moetune_kernel and facts is not None and versions.unrouted_rows(facts)
    assert ("padding: slots vLLM routes nowhere" in tuned.output) == padding
    other = invoke("lookup", "--table", tiny_table, "--preset", "tiny", "--hidden", 256,
                   "--num-tokens", 7, "--device", "cpu")
    assert "source:  rule" in other.output and "shape not in table" in other.output
    problem = dataclasses.replace(preset("tiny").shape.problem(7), hidden_size=256)
    rule = rule_choice(problem, detect_sku("cpu"))
    assert rule.kernel in other.output  # vLLM's CPU kernel where vLLM is installed


def test_lookup_and_doctor_say_vllms_own_kernel_runs_where_the_plugin_hooks_nothing(
        tiny_table, monkeypatch):
    """Serving leaves a batch-invariant vLLM, or a release it does not serve, alone; lookup
    and doctor say so."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh --vllm)")
    args = ("lookup", "--table", tiny_table, "--preset", "tiny", "--num-tokens", 7,
            "--device", "cpu")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    aside = invoke(*args)
    assert aside.exit_code == 0, aside.output
    assert "source:  vLLM" in aside.output and "VLLM_BATCH_INVARIANT=1" in aside.output
    assert "pick:    vLLM's own kernel" in aside.output
    doctor = invoke("doctor", "--device", "cpu").output
    assert "VLLM_BATCH_INVARIANT=1" in doctor and "the plugin disables itself" in doctor
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert "source:  table" in invoke(*args).output
    assert "VLLM_BATCH_INVARIANT" not in invoke("doctor", "--device", "cpu").output
    from moetune.runtime.vllm import versions

    monkeypatch.setattr(versions, "installed", lambda: "0.35.0")  # a release it does not serve
    outside = invoke(*args).output
    assert "source:  vLLM" in outside and "vLLM 0.35.0 is outside" in outside


def test_lookup_reads_the_table_and_mode_serving_reads(tiny_table, tmp_path, monkeypatch):
    args = ("lookup", "--preset", "tiny", "--num-tokens", 7, "--device", "cpu")
    monkeypatch.setenv("MOETUNE_TABLE", str(tiny_table))
    served = invoke(*args)
    assert served.exit_code == 0, served.output
    assert f"table:   {tiny_table}" in served.output and "source:  table" in served.output
    monkeypatch.setenv("MOETUNE_MODE", "off")
    off = invoke(*args).output
    assert "source:  vLLM" in off and "why:     MOETUNE_MODE=off" in off


def test_lookup_says_padding_rows_are_routed_first_where_vllm_routes_them_nowhere(
        tmp_path, monkeypatch):
    """Before a moetune kernel, serving sends the slots vLLM's routers leave without an expert
    (-1: a batch padded to a CUDA graph's size) to expert 0 at weight 0; lookup says so exactly
    where the installed vLLM does that."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh --vllm)")
    from moetune.runtime.vllm import versions
    from tests.vllm_tables import write_winners

    table = write_winners(tmp_path / "t.db", preset("tiny").shape, [1], "torch_grouped")
    args = ("lookup", "--table", table, "--preset", "tiny", "--num-tokens", 1, "--device", "cpu")
    facts = versions.facts_of(versions.installed())
    assert facts is not None and facts.padding_ids
    assert "padding: slots vLLM routes nowhere" in invoke(*args).output
    monkeypatch.setenv("VLLM_MOE_SKIP_PADDING", "0")
    assert "padding:" not in invoke(*args).output
    monkeypatch.delenv("VLLM_MOE_SKIP_PADDING")
    from moetune.runtime.registry import default_registry

    monkeypatch.setattr(default_registry.get("torch_grouped"), "skips_unrouted", True)
    assert "padding:" not in invoke(*args).output  # such a kernel takes them as they are


def test_doctor_reports_device_and_eligibility():
    result = invoke("doctor", "--device", "cpu")
    assert result.exit_code == 0
    assert "cpu:" in result.output and "torch_loop" in result.output and "eligible" in result.output
    assert "rule:    CPU rule:" in result.output  # the baseline a tune here would time
    assert "table:   none shipped for this device" in result.output


def test_doctor_lists_every_registered_family_with_its_verdict(cpu_sku):
    """Every family the registry holds, the ones added after doctor was written too, with its
    verdict for the preset's problem: why not (``supports``' reason), or what tuning does."""
    from moetune.runtime.kernels.base import BaseKernel
    from moetune.runtime.platform import Vendor
    from moetune.runtime.registry import Registry
    from moetune.tuner.report import doctor_text

    class Newcomer(BaseKernel):
        name = "newcomer"
        vendors = frozenset({Vendor.NVIDIA})

        @classmethod
        def prepare(cls, problem, params, weights):
            raise AssertionError("doctor prepares nothing")

    registry = Registry()
    registry.add(Newcomer)
    problem = preset("tiny").shape.problem(1)
    lines = doctor_text(cpu_sku, registry, problem).splitlines()
    start = lines.index(f"families for {problem.describe()} (every registered kernel):")
    listed = dict(line.split(maxsplit=1) for line in lines[start + 1:])
    assert list(listed) == registry.names() and "newcomer" in listed
    assert listed["newcomer"].startswith("no: newcomer: needs an NVIDIA GPU")
    assert listed["vllm_triton_tuned"].startswith("no: vllm_triton_tuned: needs an NVIDIA GPU")
    assert listed["reference"] == "eligible, not tuned"
    assert listed["torch_dense"].startswith("eligible, searched (")
    rule = rule_choice(problem, cpu_sku).kernel
    assert listed[rule] == "eligible, timed (no parameters), the rule's pick"


def test_doctor_says_which_vllm_the_plugin_serves_and_why_fp8_cannot_load(monkeypatch):
    from moetune.runtime.problem import DType
    from moetune.runtime.vllm import versions
    from moetune.runtime.vllm.cpu import fp8_experts_class

    shown = invoke("doctor", "--device", "cpu").output
    found = versions.installed()
    if found == "unknown":
        assert "vllm:    not installed; the plugin serves vLLM 0.32, 0.33, 0.34" in shown
    else:
        assert f"vllm:    {found}, supported" in shown
        _, why = fp8_experts_class(DType.BFLOAT16, "silu", True, False)
        assert (f"fp8:     vLLM cannot load fp8 MoE checkpoints on this CPU: {why}" in shown
                if why else "fp8:" not in shown)
    monkeypatch.setattr(versions, "installed", lambda: "0.35.1")
    shown = invoke("doctor", "--device", "cpu").output
    assert "vllm:    vLLM 0.35.1 is outside the versions moetune supports" in shown
    assert 'pip install "vllm>=0.32,<0.35"' in shown and "the plugin disables itself" in shown


def test_doctor_says_whether_the_shipped_table_is_used_here(monkeypatch):
    """Under other versions than the shipped H200 table's, doctor says it is not used, which
    versions differ and how to adopt it; under its own, how many rows it serves."""
    import moetune.runtime.dispatcher as dispatcher
    from moetune.runtime.platform import SKU, Vendor
    from moetune.runtime.registry import default_registry
    from moetune.tuner.report import doctor_text

    h200 = SKU(Vendor.NVIDIA, "H200", "sm_90", 132, 141 << 30)
    problem = preset("mixtral-8x7b").shape.problem(1)
    recorded = db.read_winners(dispatcher.shipped_table(h200)).environment

    def table_line() -> str:
        (line,) = [x for x in doctor_text(h200, default_registry, problem).splitlines()
                   if x.startswith("table:")]
        return line

    monkeypatch.setattr(dispatcher, "environment", lambda: {**recorded, "torch": "9.9.0"})
    line = table_line()
    assert "nvidia_H200.db (measured in another environment: torch 2.11 (table) != 9.9 " \
           "(here)" in line and "moetune adopt" in line
    monkeypatch.setattr(dispatcher, "environment", lambda: recorded)
    assert table_line().endswith("nvidia_H200.db (90 rows for nvidia:H200 (sm_90, 132 units))")


def test_export_import_and_merge(tiny_table, tmp_path):
    exported = tmp_path / "artifact.db"
    assert invoke("export", tiny_table, "--format", "sqlite", "--output", exported).exit_code == 0
    assert len(db.read_winners(exported).rows) == 3
    imported = tmp_path / "imported.db"
    assert invoke("import", exported, "--output", imported).exit_code == 0
    assert len(db.read_winners(imported).rows) == 3
    merged = invoke("merge", tiny_table, exported, "--output", tmp_path / "m.db")
    assert merged.exit_code == 0, merged.output
    assert len(db.read_winners(tmp_path / "m.db").rows) == 3


@pytest.mark.parametrize("args,message", [
    (["tune", "--preset", "nope", "--output", "{tmp}/x.db"], "unknown preset"),
    (["tune", "--hidden", "0", "--intermediate", "8", "--experts", "4", "--topk", "2",
      "--output", "{tmp}/x.db"], "hidden_size must be an integer from 1 to"),
    (["tune", "--preset", "tiny", "--topk", "9", "--output", "{tmp}/x.db"], "topk (9) cannot"),
    (["tune", "--preset", "tiny", "--device", "cpu", "--buckets", "1", "--output",
      "/proc/nope/x.db"], "/proc/nope"),
    (["show", "{tmp}/garbage.db"], "not a moetune table"),
    (["show", "{tmp}/missing.db"], "missing.db"),
])
def test_bad_input_gives_one_error_line_and_exit_1(tmp_path, args, message):
    (tmp_path / "garbage.db").write_bytes(b"this is not sqlite" * 100)
    result = invoke(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_failed_tune_leaves_existing_table_untouched(tiny_table, tmp_path, monkeypatch):
    from moetune.runtime.kernels.torch_loop import TorchLoopKernel

    path = tmp_path / "t.db"
    shutil.copy(tiny_table, path)
    before = db.read_winners(path).rows
    # The CPU rule for fp8_per_tensor is the torch loop (vLLM has no CPU kernel for it); a
    # loop that refuses fp8 leaves the bucket without an eligible baseline.
    monkeypatch.setattr(TorchLoopKernel, "_supports_quant",
                        classmethod(lambda cls, problem, sku: "refuses fp8 here"))
    result = invoke("tune", "--preset", "tiny", "--quant", "fp8_per_tensor", "--device", "cpu",
                    "--buckets", "1", "--output", path)
    assert result.exit_code == 1
    assert "not eligible" in result.output
    assert len(before) == 3 and db.read_winners(path).rows == before  # the run row is added


def test_lookup_defaults_to_the_shipped_table_for_this_device(tiny_table, cpu_sku, tmp_path,
                                                              monkeypatch):
    import moetune.runtime.dispatcher as dispatcher

    monkeypatch.setattr(dispatcher, "TABLES_DIR", tmp_path)
    args = ("lookup", "--preset", "tiny", "--num-tokens", 4, "--device", "cpu")
    assert "(no table configured)" in invoke(*args).output
    shutil.copy(tiny_table, dispatcher.shipped_table(cpu_sku))
    shipped = invoke(*args)
    assert "source:  table" in shipped.output and str(tmp_path) in shipped.output


def test_adopt_re_confirms_the_shipped_table_into_the_copy_serving_then_uses(
        tiny_table, cpu_sku, tmp_path, monkeypatch):
    """A table shipped from other versions serves nothing here; ``adopt`` re-times its winners
    into this machine's copy, which lookup (and serving) then use; a second ``adopt`` has
    nothing left to do, and one after the shipped table changed starts from the new one."""
    import sqlite3

    import moetune.runtime.dispatcher as dispatcher

    monkeypatch.setattr(dispatcher, "TABLES_DIR", tmp_path / "shipped")
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    assert "no table is shipped for" in invoke("adopt", "--device", "cpu").output
    shipped = dispatcher.shipped_table(cpu_sku)
    shipped.parent.mkdir()
    shutil.copy(tiny_table, shipped)
    with sqlite3.connect(shipped) as con:
        con.execute("UPDATE tuning_run SET environment = json_set(environment, '$.torch', "
                    "'1.13.1')")
    lookup = ("lookup", "--preset", "tiny", "--num-tokens", 16, "--device", "cpu")
    before = invoke(*lookup).output
    assert str(shipped) in before and "measured in another environment" in before
    assert "moetune adopt" in before

    adopted = invoke("adopt", "--device", "cpu", "--reps", 2)
    assert adopted.exit_code == 0, adopted.output
    lines = [line for line in adopted.output.splitlines() if line.startswith("M=")]
    assert len(lines) == 3 and all("winner re-timed, no search" in line for line in lines)
    copy = dispatcher.adopted_table(cpu_sku)
    assert copy == tmp_path / "home" / "tables" / shipped.name and dispatcher.default_table(
        cpu_sku) == copy
    after = invoke(*lookup).output
    assert str(copy) in after and "source:  table" in after
    assert [(r.bucket, r.median_us, r.run_id) for r in db.read_winners(shipped).rows] == [
        (r.bucket, r.median_us, r.run_id) for r in db.read_winners(tiny_table).rows]  # untouched

    again = invoke("adopt", "--device", "cpu", "--reps", 2).output
    assert again.count("skipped: already tuned (run 2: ") == 3
    run_job([preset("tiny").shape.problem(2)], shipped, cpu_sku,  # a new release's table
            JobOptions(device="cpu", trials=2, refine=0, reps=2))
    assert "the shipped table has changed since it was adopted" in invoke(
        "doctor", "--device", "cpu").output
    fresh = invoke("adopt", "--device", "cpu", "--reps", 2).output
    assert [line.split()[0] for line in fresh.splitlines() if line.startswith("M=")] == [
        "M=1", "M=2", "M=16", "M=64"]
    assert "skipped: already tuned (run 2: " in fresh  # the new release's own row is current
    copy.write_bytes(b"damaged" * 100)
    repaired = invoke("adopt", "--device", "cpu", "--reps", 2)
    assert repaired.exit_code == 0, repaired.output
    assert len(db.read_winners(copy).rows) == 4


def test_show_and_lookup_say_why_a_row_is_not_served_here(tmp_path):
    """The shipped H200 table seen from this machine: every row for another SKU; and on an
    H200 whose rule none of the rows was timed against, lookup names the stale row."""
    import sqlite3

    from moetune.runtime import dispatcher

    shipped = dispatcher.TABLES_DIR / "nvidia_H200.db"
    rows = [json.loads(line) for line in
            invoke("show", shipped, "--json", "--device", "cpu").output.strip().splitlines()]
    assert len(rows) == 90 and not any(r["served"] for r in rows)
    assert all("this device is cpu:" in r["served_reason"] for r in rows)
    assert "no: for nvidia:H200" in invoke("show", shipped, "--device", "cpu").output
    path = tmp_path / "h200.db"
    path.write_bytes(shipped.read_bytes())
    with sqlite3.connect(path) as con:  # rows timed against configs no vLLM picks here
        con.execute("""UPDATE winner SET baselines = '{"variants":[]}'""")
        con.execute("UPDATE sku SET vendor = 'cpu', name = ?, arch = ?",
                    (detect_sku("cpu").name, detect_sku("cpu").arch))
    def reasons() -> set[str]:
        shown = invoke("show", path, "--json", "--device", "cpu").output.strip().splitlines()
        return {json.loads(line)["served_reason"] for line in shown}

    # Timed under CUDA and torch 2.11: foreign here whatever their baselines.
    assert all(r.startswith("stale: measured in another environment") and "--reconfirm" in r
               for r in reasons())
    looked = invoke("lookup", "--table", path, "--preset", "mixtral-8x7b", "--num-tokens", 64,
                    "--device", "cpu").output
    assert "measured in another environment" in looked and "tune --reconfirm" in looked
    with sqlite3.connect(path) as con:  # as if timed here: only the baselines are stale
        con.execute("UPDATE tuning_run SET environment = ?", (json.dumps(environment()),))
    assert all(r.startswith("stale: tuned against") and r.endswith("re-tune this bucket")
               for r in reasons())
    looked = invoke("lookup", "--table", path, "--preset", "mixtral-8x7b", "--num-tokens", 64,
                    "--device", "cpu").output
    assert "source:  rule" in looked and "counted: fallback (the table's bucket M=64)" in looked
    assert "table row stale: tuned against" in looked and "re-tune this bucket" in looked


def test_vllms_import_warning_stays_out_of_moetunes_output():
    """A fresh process (vLLM prints its warning once, at its first import)."""
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([str(Path(sys.executable).with_name("moetune")), "lookup", "--preset",
                          "tiny", "--num-tokens", "4", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert "source:  rule" in run.stdout
    assert "Triton is installed" not in run.stdout + run.stderr


# --- invalid rows in merge, export and import: dropped with the reason `show` gives -------------
def _edited(tiny_table, path, edits):
    """A copy of the tiny table with winners changed by bucket (num_tokens -> SET clause)."""
    import sqlite3

    path.write_bytes(tiny_table.read_bytes())
    with sqlite3.connect(path) as con:
        for num_tokens, assignment in edits.items():
            con.execute(f"UPDATE winner SET {assignment} WHERE bucket_id = "
                        "(SELECT id FROM bucket WHERE num_tokens = ?)", (num_tokens,))
    return path


UNKNOWN_KERNEL = "kernel = 'gone_kernel'"
NOT_JSON = "params = '{not json'"
OUT_OF_SPACE = """kernel = 'torch_dense', params = '{"chunk_tokens": 3}'"""
STALE = """baselines = '{"variants":[]}'"""  # timed against no rule: valid, but not served


@pytest.mark.parametrize("edits", [{1: UNKNOWN_KERNEL}, {16: NOT_JSON}, {64: OUT_OF_SPACE},
                                   {1: STALE}, {1: UNKNOWN_KERNEL, 16: STALE, 64: OUT_OF_SPACE}],
                         ids=["unknown-kernel", "params-not-json", "params-out-of-space", "stale",
                              "all-three"])
def test_lookup_prints_the_plan_the_plugin_builds(tiny_table, tmp_path, edits):
    """For every num_tokens, lookup names what vLLM's plugin runs and counts, on tables with
    each kind of faulty row and a stale one (a refused bucket runs vLLM's own kernel; its
    num_tokens are not sent to a neighbour's winner)."""
    from moetune.runtime.kernels.base import WeightLayout
    from moetune.serving.settings import Settings
    from moetune.serving.state import PluginState

    path = _edited(tiny_table, tmp_path / "t.db", edits)
    plan = PluginState(Settings(table=path)).plan(preset("tiny").shape, WeightLayout.PLAIN)
    assert {m for m, c in plan.choices.items() if c.refused} == set(edits)
    for n in (1, 2, 3, 7, 12, 16, 40, 64, 300):
        choice, _ = plan.lookup(n)
        looked = invoke("lookup", "--table", path, "--preset", "tiny", "--num-tokens", n,
                        "--device", "cpu").output
        pick = choice.kernel or "vLLM's own kernel"
        assert f"pick:    {pick}" in looked and f"counted: {choice.outcome.value}" in looked, (
            n, choice, looked)
        assert f"why:     {choice.reason}" in looked
    assert "stale" in plan.summary() if STALE in edits.values() else "faulty" in plan.summary()


def _dropped(output, num_tokens, table):
    """The reason of the one ``dropped`` line for ``num_tokens`` from ``table``."""
    [line] = [ln for ln in output.splitlines() if ln.startswith("dropped ")
              and f" num_tokens={num_tokens} " in ln and f" from {table}: " in ln]
    return line.partition(f" from {table}: ")[2]


def _show(table):
    """``show --json`` on this CPU: num_tokens (or the bad row's text) -> reason."""
    rows = [json.loads(line) for line in
            invoke("show", table, "--json", "--device", "cpu").output.strip().splitlines()]
    return {r.get("num_tokens", r.get("bad_row")): r["served_reason"] for r in rows}


def test_merge_drops_invalid_rows_one_line_each_and_keeps_stale_ones(tiny_table, tmp_path):
    a = _edited(tiny_table, tmp_path / "a.db", {1: UNKNOWN_KERNEL, 16: NOT_JSON})
    b = _edited(tiny_table, tmp_path / "b.db", {64: OUT_OF_SPACE, 16: STALE})
    out = tmp_path / "m.db"
    result = invoke("merge", a, b, "--output", out)
    assert result.exit_code == 0, result.output
    assert "merged into" in result.output and ": 3 winners, 0 conflicts" in result.output
    assert _dropped(result.output, 1, a) == _show(a)[1] == "unknown kernel 'gone_kernel'"
    assert _dropped(result.output, 16, a).startswith("params are not a JSON object")
    [bad] = [text for key, text in _show(a).items() if isinstance(key, str)]
    assert bad.endswith(_dropped(result.output, 16, a))
    assert _dropped(result.output, 64, b) == _show(b)[64]
    assert _show(b)[64].startswith("invalid params: torch_dense: chunk_tokens=3 not in")
    assert len([ln for ln in result.output.splitlines() if ln.startswith("dropped ")]) == 3
    assert "stale rows kept: 1 " in result.output
    merged = {r.bucket["num_tokens"]: r for r in db.read_winners(out).rows}
    originals = {r.bucket["num_tokens"]: r for r in db.read_winners(tiny_table).rows}
    assert sorted(merged) == [1, 16, 64]
    assert merged[1].kernel == originals[1].kernel and merged[64] == originals[64]
    assert merged[16].baselines == () and _show(out)[16].startswith("stale")


def test_strict_merge_refuses_and_a_merge_of_nothing_valid_fails(tiny_table, tmp_path):
    a = _edited(tiny_table, tmp_path / "a.db", {1: UNKNOWN_KERNEL})
    bad = _edited(tiny_table, tmp_path / "bad.db",
                  {1: UNKNOWN_KERNEL, 16: NOT_JSON, 64: OUT_OF_SPACE})
    out = tmp_path / "m.db"
    strict = invoke("merge", a, tiny_table, "--output", out, "--strict")
    assert strict.exit_code == 1 and "error:" in strict.output
    assert "not written, invalid winners" in strict.output and "gone_kernel" in strict.output
    nothing = invoke("merge", bad, bad, "--output", out)
    assert nothing.exit_code == 1 and "every winner is invalid" in nothing.output
    assert nothing.output.count(" from ") == 6 and "Traceback" not in nothing.output  # each side
    assert not out.exists()
    assert invoke("merge", a, tiny_table, "--output", out).exit_code == 0  # not strict


def test_export_skips_invalid_rows_with_the_exact_reason(tiny_table, tmp_path):
    table = _edited(tiny_table, tmp_path / "t.db", {1: UNKNOWN_KERNEL, 16: OUT_OF_SPACE})
    artifact = tmp_path / "artifact.db"
    result = invoke("export", table, "--output", artifact, "--with-measurements")
    assert result.exit_code == 0, result.output
    assert f"exported 1 rows of {table} -> {artifact}" in result.output
    assert _dropped(result.output, 1, table) == "unknown kernel 'gone_kernel'"
    assert _dropped(result.output, 16, table) == _show(table)[16]
    assert [r.bucket["num_tokens"] for r in db.read_winners(artifact).rows] == [64]
    assert len(db.read_measurements(artifact)) == len(db.read_measurements(table))
    vllm = invoke("export", table, "--format", "vllm", "--output", tmp_path / "cfg")
    assert "unknown kernel 'gone_kernel'" in vllm.output and _show(table)[16] in vllm.output
    assert "gone_kernel: not a Triton fused-MoE config" not in vllm.output


def test_import_refuses_invalid_rows_and_leaves_the_table_untouched_if_none_is_valid(
        tiny_table, tmp_path):
    source = _edited(tiny_table, tmp_path / "source.db", {64: OUT_OF_SPACE})
    fresh = tmp_path / "fresh.db"
    result = invoke("import", source, "--output", fresh)
    assert result.exit_code == 0, result.output
    assert _dropped(result.output, 64, source).startswith("invalid params: torch_dense:")
    assert sorted(r.bucket["num_tokens"] for r in db.read_winners(fresh).rows) == [1, 16]
    existing = _edited(tiny_table, tmp_path / "existing.db", {1: NOT_JSON, 64: UNKNOWN_KERNEL})
    result = invoke("import", source, "--output", existing)
    assert result.exit_code == 0, result.output
    assert _dropped(result.output, 1, existing).startswith("params are not a JSON object")
    assert _dropped(result.output, 64, existing) == "unknown kernel 'gone_kernel'"
    assert _dropped(result.output, 64, source).startswith("invalid params: torch_dense:")
    assert sorted(r.bucket["num_tokens"] for r in db.read_winners(existing).rows) == [1, 16]
    bad = _edited(tiny_table, tmp_path / "bad.db",
                  {1: UNKNOWN_KERNEL, 16: NOT_JSON, 64: OUT_OF_SPACE})
    target = _edited(tiny_table, tmp_path / "target.db", {1: UNKNOWN_KERNEL, 16: NOT_JSON,
                                                           64: OUT_OF_SPACE})
    before = target.read_bytes()
    refused = invoke("import", bad, "--output", target)
    assert refused.exit_code == 1 and "every winner is invalid" in refused.output
    assert target.read_bytes() == before


def test_lookup_answers_for_another_gpu_offline_and_refuses_a_missing_one():
    """``--sku nvidia:H200`` answers from the shipped H200 table and vLLM's configs installed
    here, without a GPU; ``--device cuda`` where torch sees none is one error line."""
    import torch

    looked = invoke("lookup", "--sku", "nvidia:H200", "--preset", "mixtral-8x7b",
                    "--num-tokens", 7)
    assert looked.exit_code == 0, looked.output
    assert "nvidia:H200 (sm_90" in looked.output and "source:  table" in looked.output
    assert "counted: hit (the table's bucket M=8)" in looked.output
    unknown = invoke("lookup", "--sku", "h200", "--preset", "tiny", "--num-tokens", 7)
    assert unknown.exit_code == 1 and "expected VENDOR:NAME" in unknown.output
    if not torch.cuda.is_available():
        missing = invoke("lookup", "--device", "cuda", "--preset", "tiny", "--num-tokens", 7)
        assert missing.exit_code == 1, missing.output
        assert missing.output.startswith("error: device cuda: this machine has no GPU")
        assert len(missing.output.strip().splitlines()) == 1
