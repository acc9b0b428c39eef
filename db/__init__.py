"""Storage: table files (one SQLite file per GPU SKU) or a shared database server, their schema,
migrations and file operations.

Imports nothing from ``moetune.runtime`` or ``moetune.tuner`` (and no torch): ``db`` is the bottom
layer. The code lives in the private modules; this module only re-exports.
"""

from moetune.db._baselines import (
    BaselineRecord,
    Candidate,
    Pick,
    dump_baselines,
    minor_version,
    params_key,
    vllm_label,
)
from moetune.db._copy import export_sqlite
from moetune.db._files import TableFile, claim_in, open_table, write_table
from moetune.db._jsontext import dump_json, load_json
from moetune.db._merge import MergeConflict, MergeReport, merge_tables
from moetune.db._models import (
    Base,
    BucketRow,
    Measurement,
    MeasurementStatus,
    RunStatus,
    SkuRow,
    TuningRun,
    WinnerRow,
)
from moetune.db._history import RunRecord, read_measurements, read_runs
from moetune.db._read import TableSnapshot, WinnerRecord, read_winners
from moetune.db._reader import WinnerReader
from moetune.db._schema import HEAD_REVISION, alembic_config, file_path, is_url, schema_revision
from moetune.db._server import display_url
from moetune.db._tuning import (
    add_measurement,
    find_bucket,
    find_sku,
    finish_run,
    get_or_create_bucket,
    get_or_create_sku,
    get_run,
    measured,
    set_winner,
    start_run,
)
from moetune.db._writer import MeasurementRecord, TableWriter, WinnerEntry

__all__ = [
    "HEAD_REVISION",
    "Base",
    "BaselineRecord",
    "BucketRow",
    "Candidate",
    "Measurement",
    "MeasurementRecord",
    "MeasurementStatus",
    "MergeConflict",
    "MergeReport",
    "Pick",
    "RunRecord",
    "RunStatus",
    "SkuRow",
    "TableFile",
    "TableSnapshot",
    "TableWriter",
    "TuningRun",
    "WinnerReader",
    "WinnerEntry",
    "WinnerRecord",
    "WinnerRow",
    "add_measurement",
    "display_url",
    "dump_baselines",
    "dump_json",
    "alembic_config",
    "claim_in",
    "export_sqlite",
    "file_path",
    "find_bucket",
    "find_sku",
    "finish_run",
    "get_or_create_bucket",
    "get_or_create_sku",
    "get_run",
    "is_url",
    "load_json",
    "measured",
    "merge_tables",
    "minor_version",
    "open_table",
    "params_key",
    "read_measurements",
    "read_runs",
    "read_winners",
    "schema_revision",
    "set_winner",
    "start_run",
    "vllm_label",
    "write_table",
]
