"""The results store: one SQLite file and one schema for every results writer (the sweep writes it today).

One row per sample of one cell, keyed by ``KEY``: (model, task, length, seed, sample, recipe, version,
fingerprint, budget, format). The key is UNIQUE, so a row is never stored twice, however many writers run. Why
SQLite, and what resume means, is in docs/eval.md ("Results store").

Example::

    with Store("bench/results/grid.sqlite") as store:
        if not store.has(key):
            store.add([{**key, "score": 1.0, "bytes_held": 4096}])
"""

from __future__ import annotations

import sqlite3
import time
from contextlib import contextmanager
from functools import cache
from importlib import metadata
from pathlib import Path

KEY = ("model", "task", "length", "seed", "sample", "recipe", "version", "fingerprint", "budget", "format")
VALUES = ("provenance", "query_aware", "score", "bytes_held", "bytes_allocated", "bytes_full", "wall_s", "kl_mean",
          "kl_p99", "top1", "kl_tokens", "error", "kvcompile_version", "torch_version", "transformers_version",
          "created", "uor", "ledger")
BUSY_S = 60.0  # how long a writer waits for another one's transaction before giving up

# A stored row is final unless it failed (the next run retries the cell), or it has no KL and the new row, a
# success, has (a run with --kl adds it): a result is never replaced by another one of the same cell.
_REPLACEABLE = ("results.error IS NOT NULL OR (results.kl_mean IS NULL AND excluded.kl_mean IS NOT NULL "
                "AND excluded.error IS NULL)")


def _v1(db: sqlite3.Connection) -> None:
    """The first layout: every column but ``created``."""
    db.execute("""CREATE TABLE results (
        model TEXT NOT NULL, task TEXT NOT NULL, length INTEGER NOT NULL, seed INTEGER NOT NULL,
        sample INTEGER NOT NULL, recipe TEXT NOT NULL, version INTEGER NOT NULL, fingerprint TEXT NOT NULL,
        budget TEXT NOT NULL, format TEXT NOT NULL,
        provenance TEXT, query_aware INTEGER, score REAL, bytes_held INTEGER, bytes_allocated INTEGER,
        bytes_full INTEGER, wall_s REAL, kl_mean REAL, kl_p99 REAL, top1 REAL, kl_tokens INTEGER, error TEXT,
        kvcompile_version TEXT, torch_version TEXT, transformers_version TEXT,
        UNIQUE (model, task, length, seed, sample, recipe, version, fingerprint, budget, format))""")


def _v2(db: sqlite3.Connection) -> None:
    """When each row was written (seconds since the epoch), so a resumed grid shows its sittings; NULL for rows
    stored before version 2."""
    db.execute("ALTER TABLE results ADD COLUMN created REAL")


def _v3(db: sqlite3.Connection) -> None:
    """The union-overhead ratio of the cell's scorer at the share of tokens it kept (``eval.uor``); NULL for rows
    stored before version 3, for scorers without a per-query-head form, and for writers that do not measure it."""
    db.execute("ALTER TABLE results ADD COLUMN uor REAL")


def _v4(db: sqlite3.Connection) -> None:
    """The cell's risk ledger (``eval.ledger``, JSON): which claims are certified, bounded or empirical; NULL for
    rows stored before version 4 and for writers that do not file one."""
    db.execute("ALTER TABLE results ADD COLUMN ledger TEXT")


MIGRATIONS = [_v1, _v2, _v3, _v4]  # MIGRATIONS[i] brings a store from schema version i to i + 1; append, never edit
VERSION = len(MIGRATIONS)


class StoreError(ValueError):
    """The file is not a results store this library can read."""


class Store:
    """A results store at ``path`` (created, or migrated to ``VERSION``, on opening).

    Each ``Store`` holds one connection; open one per thread or process (any number may write at once)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, timeout=BUSY_S, isolation_level=None)  # transactions are explicit
        self.db.row_factory = sqlite3.Row
        try:
            self._wal()
            self.db.execute("PRAGMA synchronous=NORMAL")  # in WAL: a crashed process loses no commit, a power cut
            # may lose the last ones, and neither corrupts the file
            self._migrate()
        except BaseException as e:
            self.db.close()
            if type(e) is sqlite3.DatabaseError:  # "file is not a database"; a lock timeout is a subclass
                raise StoreError(f"{self.path} is not a SQLite database ({e}); give --store a new file name") from e
            raise

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _transaction(self):
        """BEGIN IMMEDIATE: take the write lock up front, so two writers queue instead of failing mid-way."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _wal(self) -> None:
        """Switch the file to WAL (readers never block the writer, nor it them). Two processes that open a new
        store at once race for that switch, and SQLite answers the loser "locked" without waiting out the busy
        timeout: retry until BUSY_S has passed."""
        deadline = time.monotonic() + BUSY_S
        while True:
            try:
                self.db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _migrate(self) -> None:
        with self._transaction():  # a second process opening a new store waits here, then finds it migrated
            found = self.db.execute("PRAGMA user_version").fetchone()[0]
            if found > VERSION:
                raise StoreError(f"{self.path} has results-store schema version {found}, newer than version {VERSION} "
                                 "that this kvcompile knows: upgrade kvcompile to read it")
            tables = self.db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            if found == 0 and tables:
                raise StoreError(f"{self.path} is a SQLite database but not a kvcompile results store (it has "
                                 "tables and no schema version); give --store a new file name")
            for migrate in MIGRATIONS[found:]:
                migrate(self.db)
            self.db.execute(f"PRAGMA user_version = {VERSION}")

    @property
    def version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def has(self, key: dict, *, kl: bool = False) -> bool:
        """Whether the cell ``key`` (a dict with every ``KEY`` field) is stored as a success (with KL if ``kl``):
        what a resumed run skips."""
        where = " AND ".join(f"{k} = ?" for k in KEY)
        row = self.db.execute(f"SELECT error, kl_mean FROM results WHERE {where}", _key(key)).fetchone()
        return row is not None and row["error"] is None and (not kl or row["kl_mean"] is not None)

    def add(self, rows: list[dict]) -> int:
        """Store ``rows`` (dicts with every ``KEY`` field and any of ``VALUES``) in one transaction; returns how
        many were written. A row whose key is stored already is dropped, unless the stored one is replaceable
        (it failed, or lacks the KL this one has). The library versions and ``created`` are filled in here."""
        columns = KEY + VALUES
        sql = (f"INSERT INTO results ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
               f"ON CONFLICT ({', '.join(KEY)}) DO UPDATE SET {', '.join(f'{c} = excluded.{c}' for c in VALUES)} "
               f"WHERE {_REPLACEABLE}")
        stamp = {**_versions(), "created": time.time()}
        unknown = {c for row in rows for c in row} - set(columns)
        if unknown:
            raise ValueError(f"unknown results-store columns {sorted(unknown)}; the columns are {list(columns)}")
        before = self.db.total_changes
        with self._transaction():
            self.db.executemany(sql, [_key(row) + tuple({**row, **stamp}.get(c) for c in VALUES) for row in rows])
        return self.db.total_changes - before

    def rows(self) -> list[dict]:
        """Every stored row, in the order they were first written."""
        return [dict(r) for r in self.db.execute("SELECT * FROM results ORDER BY rowid")]


def cell_keys(cells: list, model: str, task: str, index: int, length: int, seed: int, dtype: str) -> list[dict]:
    """The store key (and provenance) of every cell, a (recipe, budget) pair, on sample ``index`` of ``task``, for a
    model whose cache is in ``dtype``: what every writer (sweep, lm-eval, fidelity) keys its rows by."""
    context_key = {"model": model, "task": task, "length": length, "seed": seed, "sample": index}
    return [{**context_key, "recipe": r.name, "version": r.version, "fingerprint": r.fingerprint, "budget": str(b),
             "provenance": r.provenance, "format": r.format or dtype} for r, b in cells]


def _key(row: dict) -> tuple:
    missing = [k for k in KEY if row.get(k) is None]
    if missing:
        raise ValueError(f"a results-store row needs every key field; missing {missing} in {row}")
    return tuple(row[k] for k in KEY)


@cache
def _versions() -> dict:
    """The installed versions, read without importing torch: a writer need not have loaded it."""
    return {f"{name}_version": _installed(name) for name in ("kvcompile", "torch", "transformers")}


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
