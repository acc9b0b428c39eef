"""``moetune adopt``: the table shipped for this GPU, re-confirmed under the versions installed
here into this machine's copy, which serving then uses by default.

Rows are served only under the torch/Triton/CUDA versions they were timed under, and a user's
vLLM may pin others than the ones the shipped table was measured with. Adopting re-times each
bucket's winner beside the rule here (``tune --reconfirm``): seconds per bucket, no search.
The copy is resumable (buckets already timed here are skipped) and starts again from the
shipped table when that table has changed (a moetune upgrade) or the copy cannot be read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from moetune import db
from moetune.errors import TableError
from moetune.runtime.dispatcher import adopted_table, shipped_table
from moetune.runtime.platform import SKU
from moetune.runtime.problem import MoEProblem
from moetune.tuner.shapes import problems_in_table


def prepare(sku: SKU) -> tuple[Path, list[MoEProblem]]:
    """This machine's copy of the table shipped for ``sku`` (made, or made again from the
    shipped table if that has runs the copy lacks), and the buckets to re-confirm in it.

    Raises:
        TableError: no table is shipped for ``sku``.
    """
    shipped, target = shipped_table(sku), adopted_table(sku)
    if not shipped.is_file():
        raise TableError(f"no table is shipped for {sku.label()}: tune one (moetune tune ... "
                         "--output T) and serve it with MOETUNE_TABLE=T")
    if not target.is_file() or _copy_again(shipped, target):
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.copying")
        shutil.copyfile(shipped, partial)
        os.replace(partial, target)  # a reader sees the old copy or the whole new one
    return target, problems_in_table(db.read_winners(target).rows, sku)


def outdated(shipped: Path, adopted: Path) -> bool:
    """The shipped table has runs the adopted copy lacks: it changed since it was adopted."""
    return not _runs(shipped) <= _runs(adopted)


def _copy_again(shipped: Path, adopted: Path) -> bool:
    """The copy is outdated, or not a table moetune can read (damaged by hand or by a full
    disk): adopting starts again from the shipped table rather than failing on it every time.
    An unreadable shipped table is an error, and the copy is kept."""
    theirs = _runs(shipped)
    try:
        ours = _runs(adopted)
    except TableError:
        return True
    return not theirs <= ours


def _runs(path: Path) -> set[tuple[object, ...]]:
    """A table's runs, as a copy of it keeps them."""
    return {(r.started_at, r.host, r.command) for r in db.read_runs(path)}
