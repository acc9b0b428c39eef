"""Reading a table's winners a shape at a time, from a table held open.

Every vLLM process loads the table, and serves one or two of its shapes: fetching and parsing
the other rows at startup is most of what loading a large table costs (the raw fetch of 10,000
joined rows alone is ~100 ms on a 2-core CPU). ``WinnerReader`` reads the header and counts the
shapes at open, and fetches a shape's rows when asked, parsed exactly as ``read_winners`` does.
"""

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import and_, false, func, or_, select
from sqlalchemy.orm import Session

from moetune.db._files import open_table
from moetune.db._models import BUCKET_COLUMNS
from moetune.db._read import _B, _W, _WINNERS, TableSnapshot, read_header, read_snapshot
from moetune.db._schema import file_path, is_url

#: The bucket key columns but num_tokens: what a MoE layer fixes at load.
SHAPE_COLUMNS = BUCKET_COLUMNS[1:]
_SHAPE = tuple(_B[c] for c in SHAPE_COLUMNS)


class WinnerReader:
    """An open table: its header (``skus``, ``environment``, ``bad_rows``) read at open, its
    winners read on demand. Close it (or use it as a context manager) when done.

    A SQLite file at the head schema stays open (``live``): a writer replacing the file later
    (``write_table``) leaves this reader on the file it opened. An older file is read from an
    upgraded copy in memory (its one connection is bound to the opening thread), and a server
    has a transaction per read; neither is ``live``, and serving reads their rows at once.

    Thread safety: not thread-safe, callers serialize reads. A child made by ``os.fork``
    reconnects on its first read (a SQLite connection must not cross a fork), to the file at
    ``path`` then.

    Raises:
        TableError: At open, as ``open_table`` does; at a read, for a database error.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = path if is_url(path) else file_path(path)
        self._table = open_table(self.path)
        self._pid = os.getpid()
        self._in_memory = not self._table.engine.url.database
        self.live = not is_url(self.path) and not self._in_memory
        try:
            with self._session() as session:
                self._header = read_header(session)
        except BaseException:
            self._table.close()
            raise

    @property
    def skus(self) -> list[dict[str, Any]]:
        return list(self._header.skus.values())

    @property
    def environment(self) -> dict[str, Any]:
        return self._header.environment

    @property
    def bad_rows(self) -> tuple[str, ...]:
        return self._header.bad_rows

    def shapes(self, sku: tuple[str, str, str]) -> list[tuple[dict[str, Any], int]]:
        """Each distinct shape of the winners of ``sku`` (vendor, name, arch): its columns as
        stored (``SHAPE_COLUMNS``), and how many winners have it."""
        query = select(*_SHAPE, func.count()).select_from(_WINNERS) \
            .where(_W.sku_id.in_(self._sku_ids(sku))).group_by(*_SHAPE)
        with self._session() as session:
            return [(dict(zip(SHAPE_COLUMNS, values[:-1])), values[-1])
                    for values in session.execute(query)]

    def read(self, sku: tuple[str, str, str] | None = None,
             shapes: Sequence[dict[str, Any]] | None = None) -> TableSnapshot:
        """The winners, of ``sku`` and of ``shapes`` (as ``shapes()`` gives them) when given, as
        ``read_winners`` reads the whole table."""
        where = []
        if sku is not None:
            where.append(_W.sku_id.in_(self._sku_ids(sku)))
        if shapes is not None:
            where.append(or_(false(), *(and_(*(_B[c] == v for c, v in s.items()))
                                        for s in shapes)))
        with self._session() as session:
            return read_snapshot(session, self.path, self._table.revision, self._header, *where)

    def close(self) -> None:
        self._table.close()

    def __enter__(self) -> "WinnerReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sku_ids(self, sku: tuple[str, str, str]) -> list[int]:
        return [i for i, s in self._header.skus.items()
                if (s["vendor"], s["name"], s["arch"]) == sku]

    @contextlib.contextmanager
    def _session(self) -> Iterator[Session]:
        if os.getpid() != self._pid and not self._in_memory:
            self._table.engine.dispose(close=False)  # the parent's connections stay its own
            self._pid = os.getpid()
        with self._table.session() as session:
            yield session
