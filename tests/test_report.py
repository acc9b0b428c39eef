"""`moetune report`: the page and figures of a table, their numbers checked against the table,
and the ceilings a tuning run records for the floors."""

from __future__ import annotations

import dataclasses
import datetime
import html.parser
import re
import sqlite3
from pathlib import Path
from statistics import geometric_mean

import pytest
from PIL import Image
from typer.testing import CliRunner

from moetune import db
from moetune.runtime.platform import detect_sku
from moetune.runtime.problem import MoEProblem
from moetune.runtime.rules import rule_variants
from moetune.cli import app
from moetune.tuner.job import JobOptions, run_job
from moetune.tuner.presets import preset
from moetune.tuner.report_data import load_report, shape_label
from moetune.tuner.roofline import Ceilings, expert_bytes, floors_us, parse_ceilings

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CEILINGS = Ceilings(hbm_bytes_per_s=50e9, bf16_flops=2e12, copy_bytes_per_s=40e9,
                    read_bytes_per_s=50e9)
TINY = preset("tiny").shape
FP32 = MoEProblem(8, 64, 96, 8, 2, dtype="float32")
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def _baselines(problem, sku, median, times, beaten=True):
    """Rows as a tuning run stores them: every rule variant here, timed beside the winner."""
    return [db.BaselineRecord(db.Candidate(v.kernel, v.params), v.vllm, v.configs, t, t * 0.98,
                              t * 1.02, 5, t / median * 0.99, t / median * 1.01, beaten)
            for v, t in zip(rule_variants(problem, sku), times)]


#: (kernel, params, time as a multiple of the winner's or None, status) of each bucket's trials.
TRIALS = (("vllm_cpu_experts", {}, 1.3, "ok"), ("torch_loop", {}, 4.0, "ok"),
          ("torch_dense", {"n": 1}, None, "pruned"), ("torch_scaled_grouped", {}, 1.1, "ok"),
          ("torch_dense", {"n": 2}, None, "failed"), ("torch_grouped", {}, 1.0, "ok"))


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    """A CPU table written through the tuner's write API: tiny's buckets 1, 4 (served), 16
    (stale: timed against a rule no machine here picks), 64 (unknown kernel: invalid), 256
    (unreadable params); a float32 bucket whose rule was not beaten (the rule's pick runs);
    trials of every status; one run with measured ceilings, one without."""
    path = tmp_path_factory.mktemp("report") / "cpu.db"
    sku = detect_sku("cpu")
    with db.write_table(path) as t, t.session() as s:
        sku_row = db.get_or_create_sku(s, sku.vendor.value, sku.name, sku.arch,
                                       sku.compute_units, sku.memory_bytes)
        measured = db.start_run(s, sku_row, {"torch": "2.13.0"}, "moetune tune --preset tiny",
                                "abc", None, ceilings=CEILINGS.to_dict())
        plain = db.start_run(s, sku_row, {"torch": "2.13.0"}, "moetune tune --dtype float32",
                             "abc", None)
        for m, kernel, median in ((1, "torch_grouped", 10.0), (4, "torch_grouped", 20.0),
                                  (16, "torch_grouped", 40.0), (64, "no<such>kernel", 80.0),
                                  (256, "torch_grouped", 160.0)):
            problem = TINY.problem(m)
            bucket = db.get_or_create_bucket(s, **problem.to_row())
            for k, params, factor, status in TRIALS:
                us = factor and median * factor
                db.add_measurement(s, measured, bucket, k, params, us, us and us * 0.99,
                                   us and us * 1.01, 5 if us else 0, 1e-3 if us else None,
                                   status, None if us else "cannot run")
            baselines = _baselines(problem, sku, median, (median * 1.3, median * 4))
            if m == 16:
                baselines = [db.BaselineRecord(db.Candidate("aiter_triton", {"BLOCK_SIZE_M": 16}),
                                               median_us=50.0, rounds=5, ratio_lo=1.2,
                                               ratio_hi=1.3, beaten=True)]
            db.set_winner(s, sku_row, bucket, measured, kernel, {}, median, median * 0.99,
                          median * 1.01, 1e-3, baselines[0].kernel, baselines[0].params,
                          baselines[0].median_us, baselines=baselines)
        bucket = db.get_or_create_bucket(s, **FP32.to_row())
        db.add_measurement(s, plain, bucket, "torch_grouped", {}, 29.0, 28.0, 30.0, 5, 1e-6,
                           "ok", None)
        baselines = _baselines(FP32, sku, 29.0, (30.0, 90.0), beaten=False)
        db.set_winner(s, sku_row, bucket, plain, "torch_grouped", {}, 29.0, 28.0, 30.0, 1e-6,
                      baselines[0].kernel, baselines[0].params, 30.0, baselines=baselines)
        db.finish_run(s, measured, db.RunStatus.FINISHED)
        db.finish_run(s, plain, db.RunStatus.FINISHED)
    with sqlite3.connect(path) as con:  # buckets written 10 s apart, as a job writes them
        start = con.execute("SELECT started_at FROM tuning_run WHERE id = 1").fetchone()[0]
        start = datetime.datetime.fromisoformat(start)
        for n, bucket_id in enumerate(range(1, 6), 1):
            con.execute("UPDATE measurement SET created_at = ? WHERE bucket_id = ? AND run_id = 1",
                        (str(start + datetime.timedelta(seconds=10 * n)), bucket_id))
        con.execute("UPDATE winner SET params = 'not json' WHERE bucket_id = 5")
    return path


class _Tables(html.parser.HTMLParser):
    """Each <table id=...> as rows of cells: (text, data-value, class, title)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[tuple[str, str | None, str, str]]]] = {}
        self.images: list[str] = []
        self._table: str | None = None
        self._cell: dict[str, str] | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id", "")
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag == "td" and self._table is not None:
            self._cell, self._text = a, []
        elif tag == "img":
            self.images.append(a["src"])

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            c = self._cell
            self.tables[self._table][-1].append(("".join(self._text).strip(), c.get("data-value"),
                                                 c.get("class", ""), c.get("title", "")))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._text.append(data)


def _render(table_path: Path, out: Path, *args: str) -> tuple[str, _Tables]:
    result = invoke("report", table_path, "--output", out, *args)
    assert result.exit_code == 0, result.output
    page = (out / "index.html").read_text(encoding="utf-8")
    parsed = _Tables()
    parsed.feed(page)
    return page, parsed


def _slug(problem: MoEProblem) -> str:
    return re.sub(r"[^a-z0-9]+", "-", shape_label(problem.to_row()).lower()).strip("-")


def _rows(parsed: _Tables, name: str) -> dict[int, list[tuple[str, str | None, str, str]]]:
    return {int(cells[0][0]): cells[1:] for cells in parsed.tables[name] if cells}


@pytest.fixture(scope="module")
def rendered(table, tmp_path_factory) -> tuple[Path, str, _Tables]:
    out = tmp_path_factory.mktemp("rendered") / "report"
    return (out, *_render(table, out))


def test_report_files_figures_and_numbers_equal_the_table(table, rendered):
    out, page, parsed = rendered
    tiny, f32 = _slug(TINY.problem(1)), _slug(FP32)
    expected = {f"{kind}-{slug}.png" for slug in (tiny, f32)
                for kind in ("speedup", "time", "families", "convergence")} | {"tuning-time.png"}
    assert {p.name for p in out.glob("*.png")} == expected
    assert set(parsed.images) == expected  # referenced relatively, beside the page
    for png in out.glob("*.png"):
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and 5_000 < len(data) < 300_000, png.name
        with Image.open(png) as im:
            assert im.width >= 600 and 200 <= im.height <= 1400, (png.name, im.size)
            assert sum(1 for n in im.convert("L").histogram() if n) > 20, png.name  # not blank
    assert "<style>" in page and "<script" not in page and "http" not in page

    snapshot = db.read_winners(table)
    assert len(snapshot.rows) == 5 and len(snapshot.bad_rows) == 1
    by_m = _rows(parsed, f"rows-{tiny}")
    for r in snapshot.rows:
        if r.bucket["hidden_size"] != TINY.hidden_size:
            continue
        cells = by_m[r.bucket["num_tokens"]]
        values = [float(v) for _, v, _, _ in cells if v is not None]
        assert values[:3] == [r.median_us, r.baseline_us, r.speedup]
        assert f"{r.speedup:.3f}x" in [text for text, _, _, _ in cells]
        assert cells[1][0] == r.kernel
        for other in r.baselines[1:]:  # the other rule variants (vLLM's kernel, the torch loop)
            assert other.median_us in values and other.median_us / r.median_us in values
    assert sorted(by_m) == [1, 4, 16, 64]

    shapes = {cells[0][0]: cells for cells in parsed.tables["shapes"] if cells}
    tiny_row = next(c for k, c in shapes.items() if k.startswith("tiny:"))
    speedups = [r.speedup for r in snapshot.rows if r.bucket["hidden_size"] == 128]
    assert float(tiny_row[4][1]) == geometric_mean(speedups)

    floors = _rows(parsed, f"roofline-{tiny}")
    for m, cells in floors.items():
        want = floors_us(TINY.problem(m), CEILINGS)
        assert float(cells[0][1]) == want.hbm_us and float(cells[1][1]) == want.compute_us
        row = next(r for r in snapshot.rows if r.bucket["num_tokens"] == m
                   and r.bucket["hidden_size"] == 128)
        assert float(cells[2][1]) == want.roofline_us / row.median_us
        assert cells[4][0] == "4/6"  # timed / stored trials
        assert float(cells[6][1]) == 10.0  # written 10 s after the bucket before
    assert _rows(parsed, f"roofline-{f32}")[8][0][0] == "-"  # no run ceilings, none given
    assert "measured when the run started" in page


def test_stale_invalid_and_unreadable_rows_are_marked(rendered):
    _, page, parsed = rendered
    status = {m: cells[0] for m, cells in _rows(parsed, f"rows-{_slug(TINY.problem(1))}").items()}
    assert status[1][2] == "served" and status[4][2] == "served"
    assert status[16][2] == "stale" and "re-tune this bucket" in status[16][0]
    assert status[64][2] == "invalid" and "unknown kernel" in status[64][0]
    assert "no&lt;such&gt;kernel" in page and "no<such>kernel" not in page  # escaped
    assert _rows(parsed, f"rows-{_slug(FP32)}")[8][0][2] == "rule-kept"
    assert "1 invalid, 1 stale: re-tune those buckets" in page
    assert "Rows that could not be read (1)" in page and "params are not a JSON object" in page


def test_ceilings_from_the_command_line_fill_runs_that_recorded_none(table, tmp_path):
    page, parsed = _render(table, tmp_path / "r", "--ceilings",
                           "hbm_tbps=0.1,bf16_tflops=3", "--ceilings-from", "a <data> sheet")
    cells = _rows(parsed, f"roofline-{_slug(FP32)}")[8]
    given = parse_ceilings("hbm_tbps=0.1,bf16_tflops=3")
    assert float(cells[0][1]) == floors_us(FP32, given).hbm_us
    assert cells[1][0] == "-"  # float32: no matmul rate, so no compute floor and no fraction
    assert "given on the command line, the run recorded none" in page
    assert "a &lt;data&gt; sheet" in page
    tiny = _rows(parsed, f"roofline-{_slug(TINY.problem(1))}")[1]
    assert float(tiny[0][1]) == floors_us(TINY.problem(1), CEILINGS).hbm_us  # recorded wins
    page, parsed = _render(table, tmp_path / "all", "--ceilings", "hbm_tbps=0.1,bf16_tflops=3",
                           "--ceilings-for-every-run")
    tiny = _rows(parsed, f"roofline-{_slug(TINY.problem(1))}")[1]
    assert float(tiny[0][1]) == floors_us(TINY.problem(1), given).hbm_us  # given wins
    assert "given on the command line, for every run" in page


def test_given_ceilings_for_every_run_replace_the_recorded_ones(table):
    given = parse_ceilings("hbm_tbps=0.1,bf16_tflops=3")
    recorded = {v.row.bucket["num_tokens"]: v for s in load_report(table, given).shapes
                for v in s.buckets if s.label == shape_label(TINY.problem(1).to_row())}
    shared = {v.row.bucket["num_tokens"]: v for s in load_report(table, given, every_run=True)
              .shapes for v in s.buckets if s.label == shape_label(TINY.problem(1).to_row())}
    assert recorded[1].floors == floors_us(TINY.problem(1), CEILINGS)
    assert shared[1].floors == floors_us(TINY.problem(1), given) != recorded[1].floors


@pytest.mark.parametrize("text, message", [
    ("hbm_tbps=4", "at least hbm_tbps and bf16_tflops"),
    ("hbm_tbps=4,bf16_tflops=x", "bf16_tflops needs a positive number"),
    ("hbm=4,bf16_tflops=1", "unknown key 'hbm'"),
])
def test_bad_ceilings_give_one_error_line(table, tmp_path, text, message):
    result = invoke("report", table, "--output", tmp_path / "r", "--ceilings", text)
    assert result.exit_code == 1 and message in result.output
    assert not (tmp_path / "r").exists()


def test_a_table_without_trials_says_so(table, tmp_path):
    bare = tmp_path / "bare.db"
    db.export_sqlite(table, bare, include_measurements=False)
    page, _ = _render(bare, tmp_path / "r")
    assert "holds no trials" in page
    assert not list((tmp_path / "r").glob("convergence-*.png"))


def test_the_report_of_a_cpu_tuned_table(tiny_table, tmp_path):
    """The tiny preset really tuned on this CPU (the session's shared table)."""
    page, parsed = _render(tiny_table, tmp_path / "r")
    rows = _rows(parsed, f"rows-{_slug(TINY.problem(1))}")
    for r in db.read_winners(tiny_table).rows:
        cells = rows[r.bucket["num_tokens"]]
        assert cells[0][2] == "served"
        assert [float(v) for _, v, _, _ in cells if v][:3] == [r.median_us, r.baseline_us,
                                                              r.speedup]
    assert len(list((tmp_path / "r").glob("*.png"))) == 5


def test_a_run_records_the_ceilings_it_measured(tmp_path, cpu_sku):
    """The recording path of ``moetune tune --device cuda``, with the measurement injected."""
    path = tmp_path / "t.db"
    seen = []

    def measure(device):
        seen.append(device)
        return CEILINGS

    run_job([], path, cpu_sku, JobOptions(device="cuda"), measure_ceilings=measure)
    run_job([], path, cpu_sku, JobOptions(device="cpu"))  # the default: measured on CUDA only

    def broken(device):
        raise RuntimeError("CUDA out of memory")

    run_job([], path, cpu_sku, JobOptions(device="cuda"), measure_ceilings=broken)
    assert seen == ["cuda"]
    runs = db.read_runs(path)
    assert [r.ceilings for r in runs] == [CEILINGS.to_dict(), None, None]
    assert Ceilings.from_dict(runs[0].ceilings) == CEILINGS
    assert all(r.status == "finished" for r in runs)


def test_floor_arithmetic_matches_the_weights_the_kernels_read():
    import torch

    from moetune.runtime.kernels.quant import quantize_weights

    for quant in ("none", "fp8_per_tensor", "fp8_per_channel", "fp8_block_128x128"):
        problem = MoEProblem(4, 256, 384, 4, 2, quant=quant)
        w13 = torch.randn(4, 2 * 384, 256).bfloat16()
        w = quantize_weights(w13, torch.randn(4, 256, 384).bfloat16(), problem.quant)
        read = sum(t[0].numel() * t.element_size() for t in
                   (w.w13, w.w2, w.w13_scale, w.w2_scale) if t is not None)
        assert expert_bytes(problem) == read, quant
    one = MoEProblem(1, 4096, 14336, 8, 2)
    floors = floors_us(one, Ceilings(4.28e12, 774e12))
    assert floors.hbm_us == pytest.approx((2 * 352_321_536 + 2 * 4096 * 2) / 4.28e12 * 1e6)
    assert floors.compute_us == pytest.approx(2 * 2 * 3 * 4096 * 14336 / 774e12 * 1e6)
    assert floors_us(one.with_tokens(4096), Ceilings(4.28e12, 774e12)).hbm_us == pytest.approx(
        (8 * 352_321_536 + 2 * 4096 * 4096 * 2) / 4.28e12 * 1e6, rel=1e-6)


def test_report_shows_in_help():
    assert "report" in invoke("--help").output


def test_the_first_screen_says_what_is_gained_and_later_runs_collapse(tmp_path):
    """The summary and every shape's speedup figure come first; runs that each measured their
    own ceilings make one line with the ranges; a run whose process is gone reads interrupted
    (no write needed); an interval from two rounds stored as 2e+231 reads "not enough rounds"."""
    import subprocess

    path = tmp_path / "t.db"
    sku = detect_sku("cpu")
    dead = subprocess.Popen(["true"])
    dead.wait()
    with db.write_table(path) as t, t.session() as s:
        sku_row = db.get_or_create_sku(s, sku.vendor.value, sku.name, sku.arch,
                                       sku.compute_units, sku.memory_bytes)
        runs = [db.start_run(s, sku_row, {"torch": "2.13.0"}, "moetune tune", "abc", None,
                             ceilings=Ceilings(hbm, flops).to_dict())
                for hbm, flops in ((4.1e12, 7.5e14), (4.3e12, 7.9e14), (4.2e12, 7.7e14))]
        killed = db.start_run(s, sku_row, {"torch": "2.13.0"}, "moetune tune", "abc", None)
        problem = TINY.problem(1)
        bucket = db.get_or_create_bucket(s, **problem.to_row())
        baselines = _baselines(problem, sku, 10.0, (13.0, 40.0))
        baselines[0] = dataclasses.replace(baselines[0], rounds=2, ratio_lo=1.2e-3,
                                           ratio_hi=2e231)
        db.set_winner(s, sku_row, bucket, runs[0], "torch_grouped", {}, 10.0, 9.9, 10.1, 1e-3,
                      baselines[0].kernel, baselines[0].params, 13.0, baselines=baselines)
        for run in runs:
            db.finish_run(s, run, db.RunStatus.FINISHED)
        killed.pid = dead.pid
    page, parsed = _render(path, tmp_path / "r")
    summary, grid = page.index('id="summary"'), page.index('class="grid"')
    assert summary < grid < page.index(f'id="{_slug(problem)}"') < page.index('id="ceilings"')
    ceilings = re.findall(r"<li>(.*?)</li>", page[page.index('id="ceilings"'):])
    assert ceilings[0].startswith("runs 1-3: HBM 4.10-4.30 TB/s, bf16 750-790 TFLOP/s")
    assert ceilings[1].startswith("run 4: none")
    assert [cells[3][0] for cells in parsed.tables["runs"][1:]] == ["finished"] * 3 + [
        "interrupted"]
    assert "not enough rounds (2)" in page and "e+231" not in page
