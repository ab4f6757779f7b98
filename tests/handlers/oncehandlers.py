"""What tests/integration/test_once.py runs in real worker processes, and in plain child processes.

`effect_once` is a handler whose side effect (a row in the sqlite file $EFFECTS_DB) is guarded by
workers.once. It logs to $EFFECTS_LOG, one O_APPEND write per line:
    committed <pid> <seq> <delivery> <fresh> <key>    the transaction (side effect + marker) committed
    returned  <pid> <seq> <delivery> <fresh> <key>    the handler is about to return (the ack follows)
Between the two it sleeps: 0.8 s for every tenth job, else 5 ms. That is the window between the
side effect and the ack, held open so that the test's SIGKILL provably lands in it.

Run as a script (`python oncehandlers.py DRIVER TARGET KEY`), it is one delivery of a job in a
process of its own: it prints `entering`, enters once(), prints `entered <fresh>`, writes its side
effect when fresh, then waits for `commit` or `fail` on stdin before leaving the block.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import threading
import time

from workers import Job, once

WINDOW_S = 0.8
_local = threading.local()
_fd = None


def _log(event: str, job: Job, fresh: bool) -> None:
    global _fd
    if _fd is None:
        _fd = os.open(os.environ["EFFECTS_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(_fd, f"{event} {os.getpid()} {job.stream_seq} {job.delivery} {int(fresh)} {job.key}\n".encode())


def _effects() -> sqlite3.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None:
        conn = _local.conn = sqlite3.connect(os.environ["EFFECTS_DB"], timeout=60.0)
    return conn


def effect_once(job: Job) -> None:
    conn = _effects()
    with once(job, conn) as fresh:
        if fresh:
            conn.execute("INSERT INTO effects (key, pid, delivery) VALUES (?, ?, ?)", (job.key, os.getpid(), job.delivery))
    _log("committed", job, fresh)
    time.sleep(WINDOW_S if int(job.data) % 10 == 0 else 0.005)
    _log("returned", job, fresh)


def create_effects(path: str) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE effects (key TEXT, pid INTEGER, delivery INTEGER)")   # no UNIQUE: duplicates must show
    conn.commit()
    conn.close()


def connect(driver: str, target: str):
    if driver == "sqlite3":
        return sqlite3.connect(target, timeout=60.0)
    module = __import__(driver)
    return module.connect(target)


def one_delivery(driver: str, target: str, key: str) -> None:
    conn = connect(driver, target)
    job = Job(data=b"", subject="jobs.new", msg_id=key, stream="JOBS", stream_seq=1)
    print("entering", flush=True)
    with once(job, conn) as fresh:
        print(f"entered {int(fresh)}", flush=True)
        if fresh:
            conn.cursor().execute("INSERT INTO effects (key, pid, delivery) VALUES (%s, %s, %s)".replace(
                "%s", "?" if driver == "sqlite3" else "%s"), (key, os.getpid(), 1))
        if sys.stdin.readline().strip() == "fail":
            raise SystemExit("failing inside once() on purpose")
    print("done", flush=True)


if __name__ == "__main__":
    one_delivery(*sys.argv[1:4])
