"""Example handlers, also used by the demo, the tests and the benchmarks."""

import os
import sqlite3
import threading
import time

from workers import Job, once


def sleep_job(job: Job) -> None:
    """Sleep float(payload) seconds, or 0.2 s when the payload is not a number."""
    try:
        seconds = float(job.data)
    except ValueError:
        seconds = 0.2
    time.sleep(max(0.0, seconds))


def noop(job: Job) -> None:
    """Do nothing: the throughput ceiling of the supervisor itself."""


def crash_on_marker(job: Job) -> None:
    """Exit the process without acking when the payload is `crash` (every time: a poison job)
    or `crash-once` (first delivery only: the demo's crash); else behave like sleep_job."""
    marker = job.data.strip()
    if marker == b"crash" or (marker == b"crash-once" and job.delivery == 1):
        os._exit(13)
    sleep_job(job)


RECORD_ONCE_DB = "RECORD_ONCE_DB"      # the sqlite file record_once writes (default ./records.db)
_records = threading.local()           # one connection per handler thread (sqlite3 wants that)


def record_once(job: Job) -> None:
    """Record the job as one row of `records` in the sqlite file $RECORD_ONCE_DB (default
    ./records.db), exactly once however often it is delivered: the row and the job's done-marker
    commit in one transaction (workers.once). Then the rest of the job's work, standing in for
    whatever follows a side effect: a sleep, like sleep_job's. The payload `crash-after-commit`
    exits the worker on the first delivery right after the commit, before the ack: a crash in the
    worst place; the redelivery finds the marker and writes nothing (`supervisor demo --scenario once`)."""
    conn = records_connection()
    with once(job, conn) as fresh:
        if fresh:
            conn.execute("INSERT INTO records (key, stream_seq, delivery, pid, data) VALUES (?, ?, ?, ?, ?)",
                         (job.key, job.stream_seq, job.delivery, os.getpid(), job.data.decode(errors="replace")))
    if job.data.strip() == b"crash-after-commit" and job.delivery == 1:
        os._exit(13)
    sleep_job(job)


def records_connection() -> sqlite3.Connection:
    conn = getattr(_records, "conn", None)
    if conn is None:
        # A concurrent duplicate waits for the other transaction's write lock up to this timeout.
        conn = sqlite3.connect(os.environ.get(RECORD_ONCE_DB, "records.db"), timeout=60.0)
        conn.execute("CREATE TABLE IF NOT EXISTS records (key TEXT, stream_seq INTEGER, delivery INTEGER, "
                     "pid INTEGER, data TEXT, at TIMESTAMP DEFAULT CURRENT_TIMESTAMP)")
        conn.commit()
        _records.conn = conn
    return conn
