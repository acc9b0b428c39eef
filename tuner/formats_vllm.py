"""vLLM's tuned fused-MoE config files (``VLLM_TUNED_CONFIG_FOLDER``): export and import.

A file is ``E={E},N={N},device_name={dev}[,dtype={d}][,block_shape=[bn,bk]].json`` holding
``{"triton_version": ..., "<M>": {BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M,
num_warps, num_stages}}``; vLLM takes the entry nearest to the call's M. ``N`` is the
intermediate size per partition (``w2.shape[2]``), ``d`` is ``fp8_w8a8`` for every fp8 scheme
(and ``float32`` for float32 layers), ``dev`` is vLLM's device name with spaces as ``_``.

Export writes the winners of Triton kernels: ``aiter_triton`` (aiter's fork of vLLM's Triton
GEMM, which takes vLLM's config keys) exports its config as it is; kernels tuned per GEMM (``g1_``/``g2_`` parameters) export GEMM1's config, which vLLM
then runs for both GEMMs (the report counts them). Other winners are skipped and counted, and
invalid rows (unreadable, unknown kernel, params outside its space) with the reason ``show``
gives.

Import: the name gives E, N, the device and the fp8 family; hidden size and topk it lacks come
from ``ShapeHints`` (``--hidden``/``--topk`` or ``--preset``), as do the choices the name leaves
open (bf16 or fp16, per-tensor or per-channel fp8, activation, router weight on input). Each
entry becomes an ``aiter_triton`` winner of source ``vllm-json`` (the kernel moetune runs a
vLLM config with), without a time: any measured
winner beats it in ``merge``, while the dispatcher still uses it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from moetune import db
from moetune.errors import FormatError, InvalidProblemError, ShapeError
from moetune.runtime.dispatcher import row_problem
from moetune.runtime.kernels.triton_config import SPACE, config_of
from moetune.runtime.platform import SKU, Vendor
from moetune.runtime.problem import (MAX_SIZE, Activation, DType, MoEProblem, QuantScheme, Shape,
                                     parse_enum)
from moetune.runtime.vllm.configs import (
    FILE_NAME, config_file_name, device_key, selectors, vllm_device_name)
from moetune.tuner.formats_io import FormatReport, ImportedWinner, stale_note, write_winners
from moetune.tuner.presets import preset

KERNEL = "aiter_triton"
_SPLIT_NAMES = frozenset(f"{g}{n}" for g in ("g1_", "g2_") for n in SPACE)
# Arch by SKU name: what a file name cannot say; --arch covers the rest.
_ARCHES = ((r"H100|H200|H800|H20|GH200", "sm_90"), (r"B200|GB200", "sm_100"),
           (r"B300|GB300", "sm_103"), (r"A100|A800", "sm_80"),
           (r"L40S|L40|L20|L4|GEFORCE_RTX_4090|RTX_6000_ADA", "sm_89"),
           (r"MI300|MI308|MI325", "gfx942"), (r"MI350|MI355", "gfx950"))


@dataclasses.dataclass(frozen=True)
class ShapeHints:
    """What a vLLM file name does not say about the layers it serves."""

    hidden_size: int
    topk: int
    dtype: DType = DType.BFLOAT16  # files without ``dtype=`` serve bf16 and fp16 alike
    activation: Activation = Activation.SILU
    router_weight_on_input: bool = False
    fp8_scheme: QuantScheme = QuantScheme.FP8_PER_TENSOR  # ``fp8_w8a8`` without a block shape
    arch: str | None = None  # the device's arch, when its name is not one moetune knows


def shape_hints(preset_name: str | None = None, hidden: int | None = None,
                topk: int | None = None, dtype: str | None = None, quant: str | None = None,
                activation: str | None = None, router_weight_on_input: bool | None = None,
                arch: str | None = None) -> ShapeHints:
    """Hints from a preset, overridden by explicit options.

    Raises:
        ShapeError: no hidden size or topk, or a dtype a file without ``dtype=`` cannot mean.
    """
    base: dict[str, Any] = {}
    if preset_name:
        s = preset(preset_name).shape
        base = {"hidden_size": s.hidden_size, "topk": s.topk, "dtype": s.dtype,
                "activation": s.activation, "router_weight_on_input": s.router_weight_on_input,
                "fp8_scheme": s.quant}
    given = {"hidden_size": hidden, "topk": topk, "router_weight_on_input": router_weight_on_input,
             "dtype": dtype and parse_enum(DType, dtype), "fp8_scheme": quant and
             parse_enum(QuantScheme, quant), "activation": activation and
             parse_enum(Activation, activation), "arch": arch}
    base.update({k: v for k, v in given.items() if v is not None})
    if "hidden_size" not in base or "topk" not in base:
        raise ShapeError("a vLLM config file names E and N only: give --hidden and --topk "
                         "(or --preset) for the layers it serves")
    if base.get("dtype", DType.BFLOAT16) is DType.FLOAT32:
        raise ShapeError("--dtype for vLLM files is bfloat16 or float16 (float32 files "
                         "say dtype=float32 in their name)")
    if base.get("fp8_scheme") not in (QuantScheme.FP8_PER_TENSOR, QuantScheme.FP8_PER_CHANNEL):
        base.pop("fp8_scheme", None)  # the file name decides everything but this choice
    return ShapeHints(**base)


# --- names ------------------------------------------------------------------------------------
def _arch(name: str) -> str | None:
    return next((a for pattern, a in _ARCHES if re.match(rf"({pattern})[A-Z]*(_|$)", name)), None)


# --- export -----------------------------------------------------------------------------------
def export_vllm(table: Path, folder: Path, device_name: str | None = None) -> FormatReport:
    """Write the table's Triton winners as vLLM config files into ``folder``.

    Args:
        table: The moetune table.
        folder: Created if missing; files of the same name are replaced.
        device_name: vLLM's device name to use instead of the one derived from each SKU.

    Raises:
        TableError: ``table`` cannot be read.
        FormatError: no winner is a Triton config (nothing is written), or ``folder`` cannot
            be written.
    """
    snapshot = db.read_winners(table)
    device_name = device_name and re.sub(r"[\s/]+", "_", device_name.strip())
    report = FormatReport("exported")
    # file name -> shape -> num_tokens -> (config, the per-GEMM kernel if split, row)
    files: dict[str, dict[Shape, dict[int, tuple[dict[str, int], str | None,
                                                  db.WinnerRecord]]]] = {}
    guessed: set[str] = set()
    for _, _, unreadable in snapshot.bad_winners:
        report.skip(unreadable)
    for row in snapshot.rows:
        invalid = row_problem(row)
        if invalid is not None:
            report.skip(invalid)
            continue
        config, split = _triton_config(row.params)
        if config is None:
            report.skip(f"{row.kernel}: not a Triton fused-MoE config")
            continue
        if row.sku["vendor"] not in ("nvidia", "amd"):
            report.skip(f"{row.sku['vendor']} SKU: vLLM reads these files on GPUs only")
            continue
        problem = MoEProblem.from_row(row.bucket)
        dev, guess = (device_name, False) if device_name else vllm_device_name(
            row.sku["vendor"], row.sku["name"])
        if guess:
            guessed.add(dev)
        name = config_file_name(problem.num_experts, problem.intermediate_size, dev,
                                *selectors(problem))
        shapes = files.setdefault(name, {})
        shapes.setdefault(problem.shape, {})[problem.num_tokens] = (
            config, row.kernel if split else None, row)
    split_kernels: collections.Counter[str] = collections.Counter()
    written: list[db.WinnerRecord] = []
    for name, shapes in sorted(files.items()):
        shape, entries = max(shapes.items(), key=lambda kv: len(kv[1]))
        for other, rows in shapes.items():
            if other != shape:
                report.skip("shares a vLLM file with another shape (the name has no hidden "
                            "size, topk, activation or fp8 granularity)", len(rows))
        content = {"triton_version": snapshot.environment.get("triton") or "unknown"}
        content.update({str(m): entries[m][0] for m in sorted(entries)})
        report.outputs.append(_write_json(Path(folder), name, content))
        report.written += len(entries)
        written += [row for _, _, row in entries.values()]
        split_kernels.update(k for _, k, _ in entries.values() if k)
    if split_kernels:
        report.notes.append(
            f"{sum(split_kernels.values())} winners of per-GEMM kernels "
            f"({', '.join(sorted(split_kernels))}) exported with their GEMM1 config; vLLM runs "
            "one config for both GEMMs")
    report.notes += [f"device name {d} derived from the SKU name; check it against vLLM's "
                     "(or pass --device-name)" for d in sorted(guessed)]
    if not report.written:
        raise FormatError(f"{table}: nothing to export, no file written\n{report.text()}")
    stale = stale_note(written)
    if stale:
        report.notes.append(stale)
    return report


def _triton_config(params: dict[str, Any]) -> tuple[dict[str, int] | None, bool]:
    """vLLM's config inside a winner's params, and whether it is GEMM1's of a per-GEMM kernel."""
    if set(params) == set(SPACE):
        return config_of(params), False
    if set(params) == _SPLIT_NAMES:
        return config_of(params, "g1_"), True
    return None, False


def _write_json(folder: Path, name: str, content: dict[str, Any]) -> Path:
    path = folder / name
    temp = folder / f".{name}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temp.write_text(json.dumps(content, indent=4) + "\n")
        os.replace(temp, path)
    except OSError as e:
        raise FormatError(f"{path}: cannot write ({e.strerror or e})") from None
    return path


# --- import -----------------------------------------------------------------------------------
def import_vllm(source: Path, output: Path, hints: ShapeHints) -> FormatReport:
    """Import a vLLM config file, or every ``E=*.json`` in a folder, into the table ``output``.

    Raises:
        FormatError: a file name or content that is not a vLLM tuned config.
        ShapeError: shapes the hints make invalid.
    """
    source = Path(source)
    paths = sorted(source.glob("E=*.json")) if source.is_dir() else [source]
    if not paths:
        raise FormatError(f"{source}: no vLLM config files (E=...,N=...,device_name=...json)")
    report = FormatReport("imported", outputs=[Path(output)])
    winners: list[ImportedWinner] = []
    versions: collections.Counter[str] = collections.Counter()
    for path in paths:
        winners += _read_file(path, hints, report, versions)
    overrides = {"triton": versions.most_common(1)[0][0]} if versions else {}
    if len(versions) > 1:
        report.notes.append(f"files name several Triton versions {sorted(versions)}; the "
                            f"table records {overrides['triton']}")
    merged = write_winners(winners, Path(output), str(source), report, overrides)
    report.notes.append("vLLM files carry no times: winners stored without one (any measured "
                        "winner replaces them in a merge)")
    if merged is not None:
        report.notes.append(f"merged into the existing table ({len(merged.conflicts)} conflicts)")
    return report


def _read_file(path: Path, hints: ShapeHints, report: FormatReport,
               versions: collections.Counter[str]) -> list[ImportedWinner]:
    m = FILE_NAME.match(path.name)
    if m is None:
        raise FormatError(f"{path}: not a vLLM tuned-config file name; expected "
                          "E={E},N={N},device_name={device}[,dtype=...][,block_shape=[n,k]].json")
    if m["down"]:  # GEMM2-only configs: a moetune row holds both GEMMs' configs
        report.skip(f"{path.name}: a GEMM2-only (_down.json) file, not imported")
        return []
    version, configs = _load_configs(path)
    dtype, quant = hints.dtype, QuantScheme.NONE
    if m["dtype"] == "float32":
        dtype = DType.FLOAT32
    elif m["dtype"] == "fp8_w8a8":
        quant = QuantScheme.FP8_BLOCK_128X128 if m["bn"] else hints.fp8_scheme
    elif m["dtype"] is not None:
        report.skip(f"dtype={m['dtype']}: no such moetune quant scheme", len(configs))
        return []
    if m["bn"] and (m["bn"], m["bk"]) != ("128", "128"):
        report.skip(f"block_shape=[{m['bn']},{m['bk']}]: moetune has 128x128 only", len(configs))
        return []
    sku = _sku(m["dev"], hints)
    if isinstance(sku, str):
        report.skip(sku, len(configs))
        return []
    if version:
        versions[version] += 1
    winners: list[ImportedWinner] = []
    dropped: collections.Counter[str] = collections.Counter()
    for key, config in configs.items():
        if len(key) > len(str(MAX_SIZE)) or int(key) > MAX_SIZE:  # the file's others still count
            shown = key if len(key) <= 20 else key[:17] + "..."
            report.skip(f"{path.name}: entry {shown}: num_tokens must be an integer from 1 to "
                        f"{MAX_SIZE}")
            continue
        dropped.update(set(config) - set(SPACE))
        params = {n: config[n] for n in SPACE}  # checked with every row in ``write_winners``
        try:
            problem = MoEProblem(int(key), hints.hidden_size, int(m["N"]), int(m["E"]), hints.topk,
                                 dtype, quant, hints.activation, True,
                                 hints.router_weight_on_input)
        except InvalidProblemError as e:
            raise ShapeError(f"{path}: {e}") from None
        winners.append(ImportedWinner(sku, problem, KERNEL, params, None, "vllm-json"))
    if dropped:
        report.notes.append(f"{path.name}: dropped {', '.join(sorted(dropped))} (no such "
                            f"{KERNEL} parameter)")
    return winners


def _load_configs(path: Path) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """(triton_version, {token count: config}) of a file, checked to be a vLLM config."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        raise FormatError(f"{path}: not a vLLM tuned config: cannot read JSON ({e})") from None
    entries = {k: v for k, v in data.items() if k != "triton_version"} if isinstance(
        data, dict) else {}
    if not entries:
        raise FormatError(f"{path}: not a vLLM tuned config: expected a JSON object mapping "
                          "token counts to Triton configs")
    for key, config in entries.items():
        if not (key.isascii() and key.isdigit() and key.strip("0") and isinstance(config, dict)
                and all(isinstance(config.get(n), int) for n in SPACE)):
            raise FormatError(f"{path}: not a vLLM tuned config: entry {key!r} must map a token "
                              f"count to a config with integer {', '.join(SPACE)}")
    version = data.get("triton_version")
    return (version if isinstance(version, str) else None), entries


def _sku(device_name: str, hints: ShapeHints) -> SKU | str:
    """The SKU a file's device name means, or why there is none."""
    key = device_key(device_name)
    if key is None:
        return f"device {device_name}: neither NVIDIA nor AMD"
    arch = hints.arch or _arch(key[1])
    if arch is None:
        return f"device {device_name}: unknown arch (pass --arch, e.g. sm_90 or gfx942)"
    return SKU(Vendor(key[0]), key[1], arch, 0, 0)  # 0: unknown compute units and memory
