"""``record`` mode's missed buckets: gathered in memory during serving, appended at exit.

The forward pass does no I/O, so a call only adds its bucket to a set; ``flush`` (at process
exit, with the counters) appends the new ones to the file, one JSON problem per line, leaving
out lines the file already holds (another process or an earlier run wrote them).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from moetune.runtime.problem import MoEProblem

logger = logging.getLogger("moetune")


class MissLog:
    """Missed buckets of one process, written to ``path`` by ``flush``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pending: dict[str, None] = {}  # ordered set of JSON lines
        self._lock = threading.Lock()

    def add(self, problem: MoEProblem) -> None:
        """Remember ``problem``'s bucket (no I/O)."""
        line = json.dumps(problem.bucket().to_row(), sort_keys=True)
        with self._lock:
            self._pending[line] = None

    def flush(self) -> None:
        """Append the buckets the file does not hold yet; a write error is one warning."""
        with self._lock:
            lines, self._pending = list(self._pending), {}
        existing = _existing_lines(self.path)
        new = [line for line in lines if line not in existing]
        if not new:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in new))
        except OSError as e:
            logger.warning("moetune: cannot record %d missed buckets to %s: %s", len(new),
                           self.path, e)


def _existing_lines(path: Path) -> set[str]:
    """Lines already in the misses file, normalised, so reruns do not append duplicates."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return set()
    lines = set()
    for raw in text.splitlines():
        try:
            lines.add(json.dumps(json.loads(raw), sort_keys=True))
        except ValueError:
            continue
    return lines
