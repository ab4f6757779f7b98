"""The idempotent consumer: a side effect and its done-marker commit together, or neither does.

    from workers import once

    def handle(job):
        with once(job, conn) as fresh:        # conn: a sqlite3 or psycopg connection
            if fresh:
                conn.execute("INSERT INTO payments ...")

JetStream delivers at least once: a worker that dies after its side effect and before its ack
runs the job again on redelivery, and nothing NATS can do prevents that, because the side effect
lives outside NATS. What does prevent it is recording "job.key is done" in the same database
transaction as the side effect. `once()` opens that transaction, inserts `job.key` into the
table `jetstream_supervisor_done` (created on first use) before the body runs, commits on a normal
exit and rolls back on an exception. When the key is already there, `fresh` is False and the body
skips the side effect; the job is then acked as usual.

Concurrent duplicates (two deliveries of one job running at once on two workers) are serialised
by the database, not by us: the marker insert is the transaction's first write, so the second
transaction waits on the first one's lock (sqlite: BEGIN IMMEDIATE takes the write lock and waits
up to the connection's busy timeout; PostgreSQL: INSERT ... ON CONFLICT DO NOTHING waits for the
other transaction's uncommitted row) and then sees the key: fresh is False. If the first rolls
back instead, the second inserts the key and runs the body.

Supported: sqlite3 (qmark) and psycopg 3 / psycopg2 (pyformat), sync connections. The connection
must have no transaction open when once() starts: once() commits, and committing someone else's
half-done writes behind their back would be worse than refusing.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

TABLE = "jetstream_supervisor_done"
CREATE = (f"CREATE TABLE IF NOT EXISTS {TABLE} (key TEXT PRIMARY KEY, stream_seq BIGINT, "
          "done_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)")
# ON CONFLICT DO NOTHING: PostgreSQL 9.5+, sqlite 3.24+. Under PostgreSQL it waits for a concurrent
# uncommitted insert of the same key, which is exactly the serialisation we need.
CLAIM = f"INSERT INTO {TABLE} (key, stream_seq) VALUES ({{p}}, {{p}}) ON CONFLICT (key) DO NOTHING"
PLACEHOLDERS = {"qmark": "?", "format": "%s", "pyformat": "%s"}
NEEDS = "a sync DB-API 2 connection from sqlite3, psycopg (3) or psycopg2"


@dataclass(frozen=True)
class Dialect:
    """How one driver opens, checks and ends a transaction; the SQL itself is shared."""
    driver: str
    claim_sql: str
    idle: Callable[[Any], bool]          # no transaction open on the connection
    begin_sql: str | None                # None: the driver opens one on the first statement

    def begin(self, conn: Any) -> None:
        if not self.idle(conn):
            raise RuntimeError(f"once() opens its own transaction, but this {self.driver} connection has one "
                               "open already: commit or roll back before once()")
        if self.begin_sql:
            conn.cursor().execute(self.begin_sql)

    def end(self, conn: Any, commit: bool) -> None:
        if self.driver != "sqlite3" and conn.autocommit:
            # psycopg2 ignores commit()/rollback() in autocommit mode: end the BEGIN we sent ourselves.
            conn.cursor().execute("COMMIT" if commit else "ROLLBACK")
        elif commit:
            conn.commit()
        else:
            conn.rollback()


def _sqlite_idle(conn: Any) -> bool:
    return not conn.in_transaction


def _pg_idle(conn: Any) -> bool:
    info = getattr(conn, "info", None)             # psycopg 3
    status = info.transaction_status if info is not None else conn.get_transaction_status()
    return int(status) == 0                        # IDLE in both drivers


def dialect_of(conn: Any) -> Dialect:
    """The dialect for `conn`, or a TypeError that says what once() needs."""
    driver = _driver(conn)
    if driver is None or type(conn).__name__.startswith("Async"):
        raise TypeError(f"once() needs {NEEDS}; got {type(conn).__module__}.{type(conn).__qualname__}")
    paramstyle = getattr(sys.modules.get(driver), "paramstyle", "")
    if paramstyle not in PLACEHOLDERS:
        raise TypeError(f"once() needs {NEEDS}; {driver}.paramstyle is {paramstyle!r}")
    claim = CLAIM.format(p=PLACEHOLDERS[paramstyle])
    if driver == "sqlite3":
        # IMMEDIATE: take the write lock now, so a concurrent duplicate waits here (busy timeout),
        # not after it has read a snapshot it can no longer write from.
        return Dialect(driver, claim, _sqlite_idle, "BEGIN IMMEDIATE")
    return Dialect(driver, claim, _pg_idle, None if not conn.autocommit else "BEGIN")


def _driver(conn: Any) -> str | None:
    for cls in type(conn).__mro__:
        top = cls.__module__.split(".")[0]
        if top in ("sqlite3", "psycopg", "psycopg2") and hasattr(conn, "cursor") and hasattr(conn, "commit"):
            return top
    return None


# Connections whose marker table is known to exist (PostgreSQL only: sqlite creates it inside the
# transaction for free, and its connections cannot be weakly referenced anyway).
_tables_seen: weakref.WeakSet[Any] = weakref.WeakSet()


def _ensure_table_pg(conn: Any, dialect: Dialect) -> None:
    """CREATE TABLE IF NOT EXISTS in a transaction of its own: two of them racing in PostgreSQL can
    fail with a unique violation in the catalog, which must not cost the body's transaction."""
    if conn in _tables_seen:
        return
    dialect.begin(conn)
    try:
        conn.cursor().execute(CREATE)
    except Exception:
        dialect.end(conn, commit=False)
        dialect.begin(conn)                        # the other creator committed: check it is there
        conn.cursor().execute(f"SELECT 1 FROM {TABLE} WHERE FALSE")
    dialect.end(conn, commit=True)
    _tables_seen.add(conn)


@contextmanager
def once(job: Any, conn: Any) -> Iterator[bool]:
    """`with once(job, conn) as fresh:` runs the body in one transaction with job.key's done-marker;
    fresh is False when the key was already recorded (skip the side effect)."""
    dialect = dialect_of(conn)
    key = getattr(job, "key", None)
    if not isinstance(key, str) or not key:
        raise TypeError(f"once() needs a job with a non-empty str .key (a workers.Job); got {type(job).__name__}")
    if dialect.driver != "sqlite3":
        _ensure_table_pg(conn, dialect)
    dialect.begin(conn)
    try:
        cursor = conn.cursor()
        if dialect.driver == "sqlite3":
            cursor.execute(CREATE)
        cursor.execute(dialect.claim_sql, (key, getattr(job, "stream_seq", None)))
        fresh = cursor.rowcount == 1
        yield fresh
    except BaseException:
        dialect.end(conn, commit=False)
        raise
    dialect.end(conn, commit=True)
