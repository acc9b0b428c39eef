"""aiter's fused-MoE table, ``tuned_fmoe.csv`` (``AITER_CONFIG_FMOE``): import and export.

aiter looks a call up by exact key, ``cu_num, token, model_dim, inter_dim, expert, topk,
act_type, dtype, q_dtype_a, q_dtype_w, q_type, use_g1u1, doweight_stage1``, with ``token``
padded first (1-16 -> 16, then the next power of two, 1024 and above -> 1024), and runs the
row's ``block_m``, ``kernelName1``/``kernelName2`` and ``run_1stage``.

Import: each row becomes a bucket (token -> num_tokens, model_dim -> hidden, inter_dim ->
intermediate, doweight_stage1 -> router weight on input, q_type with q_dtype_w -> our scheme)
with the winner ``aiter_fused_moe`` pinned to the row's ``block_m`` and the row's ``us`` as its
time. That time is aiter's tuner's: the sum of the stages, without sorting or quantization, so
it reads faster than moetune's end-to-end medians. Its baseline is ``block_size_M=0`` (aiter's
own pick, which is this row while the CSV is active) at the same time. The device comes from
``cu_num``: 80 -> MI308X and 304 -> MI300X (gfx942), 256 -> MI355X (gfx950); MI325X shares
304 and MI350X 256 compute units, so rename the SKU if that is your device. Rows moetune cannot
represent or run (int8/int4/fp4, g1u0, router weight on input with topk > 1, times <= 0, other
cu_num) are counted in the report, never fatal.

Export: ``aiter_fused_moe`` winners with a pinned ``block_size_M`` become rows. moetune tunes
``block_size_M`` only; the kernels aiter ran with it are the ones of the active CSV's row for
that key (``base``, by default the installed aiter's), so the exported row keeps that row's
kernel names, ``ksplit`` and ``run_1stage``, sets ``block_m`` and ``us`` (moetune's median),
and leaves the per-stage columns empty. Keys absent from ``base`` ran aiter's heuristic
kernels, which a CSV row cannot express (an empty kernel name reads back as NaN), so they are
skipped and counted; so are invalid rows (unreadable, unknown kernel, params outside its
space), with the reason ``show`` gives.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from moetune import db
from moetune.errors import FormatError, MoetuneError
from moetune.runtime.dispatcher import row_problem
from moetune.runtime.kernels.aiter_fused_moe import AiterFusedMoeKernel
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import Activation, DType, MoEProblem, QuantScheme
from moetune.tuner.formats_io import FormatReport, ImportedWinner, stale_note, write_winners

KEY_COLUMNS = ("cu_num", "token", "model_dim", "inter_dim", "expert", "topk", "act_type",
               "dtype", "q_dtype_a", "q_dtype_w", "q_type", "use_g1u1", "doweight_stage1")
COLUMNS = KEY_COLUMNS + ("block_m", "ksplit", "us1", "kernelName1", "err1", "us2",
                         "kernelName2", "err2", "us", "run_1stage", "tflops", "bw")
REQUIRED = KEY_COLUMNS + ("block_m", "us")
KERNEL = AiterFusedMoeKernel.name

#: cu_num -> (SKU name, arch, memory bytes).
CU_SKUS = {80: ("MI308X", "gfx942", 192 << 30), 304: ("MI300X", "gfx942", 192 << 30),
           256: ("MI355X", "gfx950", 288 << 30)}
FP8 = {"gfx942": "torch.float8_e4m3fnuz", "gfx950": "torch.float8_e4m3fn"}
DTYPES = {"torch.bfloat16": DType.BFLOAT16, "torch.float16": DType.FLOAT16}
ACTIVATIONS = {"ActivationType.Silu": Activation.SILU, "ActivationType.Gelu": Activation.GELU}
QUANTS = {"QuantType.No": QuantScheme.NONE, "QuantType.per_Tensor": QuantScheme.FP8_PER_TENSOR,
          "QuantType.per_Token": QuantScheme.FP8_PER_CHANNEL,
          "QuantType.per_1x128": QuantScheme.FP8_BLOCK_128X128,
          "QuantType.per_128x128": QuantScheme.FP8_BLOCK_128X128}
_BLOCK_MS = tuple(c for c in AiterFusedMoeKernel.params[0].choices if c)


def padded_tokens(m: int) -> int:
    """aiter's ``get_padded_M``: the ``token`` a call with ``m`` tokens looks up."""
    if m <= 16:
        return 16
    return 1 << (m - 1).bit_length() if m < 1024 else 1024


def installed_csv() -> Path | None:
    """The installed aiter's ``configs/tuned_fmoe.csv`` (found without importing aiter)."""
    spec = importlib.util.find_spec("aiter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), "configs", "tuned_fmoe.csv")
    return path if path.exists() else None


def read_csv(path: Path) -> list[dict[str, str]]:
    """The rows of an aiter fMoE CSV.

    Raises:
        FormatError: unreadable, or without the key columns, ``block_m`` and ``us``.
    """
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            columns = [c.strip() for c in reader.fieldnames or ()]
            missing = [c for c in REQUIRED if c not in columns]
            if missing:
                raise FormatError(f"{path}: not aiter's tuned_fmoe.csv: missing columns "
                                  f"{', '.join(missing)}")
            return [{k.strip(): (v or "").strip() for k, v in row.items() if k} for row in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise FormatError(f"{path}: cannot read as CSV ({e})") from None


# --- import -----------------------------------------------------------------------------------
def import_aiter(source: Path, output: Path) -> FormatReport:
    """Import aiter's ``tuned_fmoe.csv`` into the table ``output`` (merged if it exists).

    Raises:
        FormatError: not an aiter fMoE CSV, or no row moetune can use.
    """
    report = FormatReport("imported", outputs=[Path(output)])
    winners = []
    for row in read_csv(Path(source)):
        winner = row_winner(row)
        if isinstance(winner, str):
            report.skip(winner)
        else:
            winners.append(winner)
    merged = write_winners(winners, Path(output), str(source), report)
    if merged is not None:
        report.notes.append(f"merged into the existing table ({len(merged.conflicts)} conflicts)")
    return report


def row_winner(row: dict[str, str]) -> ImportedWinner | str:
    """One CSV row as a winner, or why it cannot be one."""
    try:
        ints = {c: int(row[c]) for c in ("cu_num", "token", "model_dim", "inter_dim", "expert",
                                          "topk", "use_g1u1", "doweight_stage1", "block_m")}
        us = float(row["us"])
    except ValueError:
        return "a number column is not a number"
    if ints["cu_num"] not in CU_SKUS:
        return f"cu_num {ints['cu_num']}: unknown device"
    name, arch, memory = CU_SKUS[ints["cu_num"]]
    sku = SKU(Vendor.AMD, name, arch, ints["cu_num"], memory)
    dtype, act, quant = (DTYPES.get(row["dtype"]), ACTIVATIONS.get(row["act_type"]),
                         QUANTS.get(row["q_type"]))
    if dtype is None or act is None or quant is None:
        return f"{row['dtype']} {row['act_type']} {row['q_type']}: no moetune equivalent"
    weight_dtype = row["dtype"] if quant is QuantScheme.NONE else FP8[arch]
    if (row["q_dtype_a"], row["q_dtype_w"]) != (weight_dtype, weight_dtype):
        return f"{row['q_type']} with {row['q_dtype_w']} weights on {arch}: no moetune scheme"
    if ints["use_g1u1"] != 1:
        return "g1u0 (ungated) layer"
    if ints["block_m"] not in _BLOCK_MS or row.get("ksplit", "0") not in ("0", ""):
        return f"block_m {ints['block_m']} / ksplit {row.get('ksplit')}: not a moetune parameter"
    if not (math.isfinite(us) and us > 0):
        return "time us <= 0 (a corrupt row)"
    try:
        problem = MoEProblem(ints["token"], ints["model_dim"], ints["inter_dim"], ints["expert"],
                             ints["topk"], dtype, quant, act, True, bool(ints["doweight_stage1"]))
    except MoetuneError as e:
        return f"invalid shape ({e})"
    why = AiterFusedMoeKernel.unsupported(problem, sku)
    if why:
        return f"{KERNEL}: {why}"
    return ImportedWinner(sku, problem, KERNEL, {"block_size_M": ints["block_m"]}, us,
                          "aiter-csv", baseline_params={"block_size_M": 0})


# --- export -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Pick:
    key: tuple[str, ...]
    num_tokens: int
    block_m: int
    median_us: float | None
    row: db.WinnerRecord


def export_aiter(table: Path, output: Path, base: Path | None = None) -> FormatReport:
    """Write the table's ``aiter_fused_moe`` winners as a ``tuned_fmoe.csv`` at ``output``.

    Args:
        table: The moetune table.
        output: The CSV to write (replaced if it exists).
        base: The aiter CSV that was active while tuning (default: the installed aiter's).

    Raises:
        TableError: ``table`` cannot be read.
        FormatError: no base CSV, no row to write (nothing is written), or ``output`` cannot
            be written.
    """
    base = base or installed_csv()
    if base is None:
        raise FormatError("no aiter tuned_fmoe.csv to take kernel names from: pass --aiter-base")
    base_rows = {tuple(r[c] for c in KEY_COLUMNS): r for r in read_csv(base)}
    report = FormatReport("exported", outputs=[Path(output)])
    picks: dict[tuple[str, ...], _Pick] = {}
    snapshot = db.read_winners(table)
    for _, _, unreadable in snapshot.bad_winners:
        report.skip(unreadable)
    for row in snapshot.rows:
        pick = _pick(row, report)
        if pick is None:
            continue
        old = picks.get(pick.key)
        if old is not None:
            report.skip("another bucket has the same padded token (aiter pads M to a power of "
                        "two, 16 minimum, 1024 maximum); kept the one nearest the padded token")
            pick = min(old, pick, key=lambda p: (abs(int(p.key[1]) - p.num_tokens), -p.num_tokens))
        picks[pick.key] = pick
    rows, written = [], []
    for key, pick in sorted(picks.items(), key=lambda kv: [int(v) if v.isdigit() else v
                                                           for v in kv[0]]):
        known = base_rows.get(key)
        if known is None:
            report.skip(f"no row in {base.name} for the key: aiter chose its kernels by "
                        "heuristic, which a CSV row cannot express")
            continue
        us = "" if pick.median_us is None else repr(pick.median_us)
        rows.append({**known, "block_m": str(pick.block_m), "us": us,
                     "us1": "", "err1": "", "us2": "", "err2": "", "tflops": "", "bw": ""})
        written.append(pick.row)
    if not rows:
        raise FormatError(f"{table}: nothing to export, no file written\n{report.text()}")
    _write_csv(Path(output), rows)
    report.written = len(rows)
    report.notes.append(f"kernel names, ksplit and run_1stage from {base}; us is moetune's "
                        "end-to-end median")
    stale = stale_note(written)
    if stale:
        report.notes.append(stale)
    return report


def _pick(row: db.WinnerRecord, report: FormatReport) -> _Pick | None:
    invalid = row_problem(row)
    if invalid is not None:
        report.skip(invalid)
        return None
    if row.kernel != KERNEL:
        report.skip(f"{row.kernel}: not configured by tuned_fmoe.csv")
        return None
    arch, cu = row.sku["arch"], row.sku["compute_units"]
    if row.sku["vendor"] != "amd" or arch not in FP8:
        report.skip(f"{row.sku['name']} ({arch}): not an aiter device")
        return None
    if not row.params.get("block_size_M"):
        report.skip("block_size_M 0 (aiter's own choice): nothing to pin")
        return None
    p = MoEProblem.from_row(row.bucket)
    dtype = {DType.BFLOAT16: "torch.bfloat16", DType.FLOAT16: "torch.float16"}.get(p.dtype)
    if dtype is None:
        report.skip(f"dtype {p.dtype.value}: aiter runs bf16/fp16")
        return None
    weights = dtype if p.quant is QuantScheme.NONE else FP8[arch]
    q_type = {v: k for k, v in QUANTS.items() if k != "QuantType.per_128x128"}[p.quant]
    act = {v: k for k, v in ACTIVATIONS.items()}[p.activation]
    key = (str(cu), str(padded_tokens(p.num_tokens)), str(p.hidden_size),
           str(p.intermediate_size), str(p.num_experts), str(p.topk), act, dtype, weights,
           weights, q_type, str(int(p.gated)), str(int(p.router_weight_on_input)))
    return _Pick(key, p.num_tokens, row.params["block_size_M"], row.median_us, row)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    try:
        with open(temp, "w", newline="") as f:
            writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore", lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(temp, path)
    except OSError as e:
        temp.unlink(missing_ok=True)
        raise FormatError(f"{path}: cannot write ({e.strerror or e})") from None
