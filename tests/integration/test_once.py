"""workers.once: the idempotent consumer. A side effect and its done-marker commit together, so a
job delivered twice (a worker SIGKILLed between its side effect and its ack; two deliveries running
at once) has its side effect once. sqlite3 always; PostgreSQL (psycopg 3 and psycopg2) against a
real server when the PostgreSQL binaries are installed."""

from __future__ import annotations

import random
import re
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import oncehandlers
import pgserver
import psutil
import pytest
from harness import HANDLERS, child_env, publish, run_cli, wait_until

from workers import Job, once
from workers.once import TABLE


def job(key: str | None = None, seq: int = 7) -> Job:
    return Job(data=b"", subject="jobs.new", msg_id=key, stream="JOBS", stream_seq=seq)


# ---------------------------------------------------------------- Job.key

def test_job_key_is_the_msg_id_else_stream_and_sequence():
    assert job("order-17").key == "order-17"
    assert job(None, seq=42).key == "JOBS:42"


# ---------------------------------------------------------------- sqlite, one process

@pytest.fixture
def db(tmp_path):
    conn = sqlite3.connect(tmp_path / "app.db")
    conn.execute("CREATE TABLE effects (key TEXT)")
    conn.commit()
    yield conn
    conn.close()


def rows(conn, sql: str) -> list:
    return conn.execute(sql).fetchall()


def test_first_delivery_is_fresh_and_commits_marker_with_side_effect(db):
    assert not rows(db, "SELECT name FROM sqlite_master WHERE name = 'jetstream_supervisor_done'")
    with once(job("a"), db) as fresh:
        assert fresh is True
        db.execute("INSERT INTO effects VALUES ('a')")
    assert not db.in_transaction
    assert rows(db, f"SELECT key, stream_seq FROM {TABLE}") == [("a", 7)]     # table created on first use
    assert rows(db, "SELECT key FROM effects") == [("a",)]


def test_second_delivery_is_not_fresh(db):
    for _ in range(3):
        with once(job("a"), db) as fresh:
            if fresh:
                db.execute("INSERT INTO effects VALUES ('a')")
    assert rows(db, "SELECT count(*) FROM effects") == [(1,)]
    with once(job("b"), db) as fresh:
        assert fresh is True


def test_exception_rolls_back_side_effect_and_marker(db):
    with once(job("other"), db):
        pass
    with pytest.raises(ValueError):
        with once(job("a"), db) as fresh:
            assert fresh
            db.execute("INSERT INTO effects VALUES ('a')")
            raise ValueError("the body failed")
    assert rows(db, "SELECT count(*) FROM effects") == [(0,)]
    assert rows(db, f"SELECT key FROM {TABLE}") == [("other",)]
    with once(job("a"), db) as fresh:        # the redelivery runs it for real
        assert fresh is True


def test_autocommit_connection_works_too(tmp_path):
    conn = sqlite3.connect(tmp_path / "x.db", isolation_level=None)
    conn.execute("CREATE TABLE effects (key TEXT)")
    with pytest.raises(RuntimeError):
        with once(job("a"), conn):
            conn.execute("INSERT INTO effects VALUES ('a')")
            raise RuntimeError("boom")
    assert rows(conn, "SELECT count(*) FROM effects") == [(0,)]
    with once(job("a"), conn) as fresh:
        conn.execute("INSERT INTO effects VALUES ('a')")
    assert fresh and rows(conn, "SELECT count(*) FROM effects") == [(1,)]


def test_open_transaction_is_refused_not_committed(db):
    db.execute("INSERT INTO effects VALUES ('not mine')")         # legacy sqlite3 opens a transaction here
    with pytest.raises(RuntimeError, match="commit or roll back before once"):
        with once(job("a"), db):
            pass
    db.rollback()
    assert rows(db, "SELECT count(*) FROM effects") == [(0,)]


class NotADbApiConnection:
    def cursor(self):
        raise AssertionError("once() must not touch a connection it does not support")


@pytest.mark.parametrize("conn", [object(), NotADbApiConnection(), "sqlite:///x.db"])
def test_unsupported_connection_is_a_type_error_naming_what_is_needed(conn):
    with pytest.raises(TypeError, match=r"once\(\) needs a sync DB-API 2 connection from sqlite3, psycopg \(3\) "
                                        r"or psycopg2; got "):
        with once(job("a"), conn):
            pytest.fail("the body must not run")


def test_job_without_a_key_is_a_type_error(db):
    with pytest.raises(TypeError, match="non-empty str .key"):
        with once(object(), db):
            pytest.fail("the body must not run")


# ---------------------------------------------------------------- concurrent duplicates, two processes

class Delivery:
    """One delivery of a job in a process of its own (tests/handlers/oncehandlers.py as a script)."""

    def __init__(self, driver: str, target: str, key: str):
        self.proc = subprocess.Popen([sys.executable, str(HANDLERS / "oncehandlers.py"), driver, target, key],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=child_env())

    def line(self) -> str:
        text = self.proc.stdout.readline().strip()
        assert text, f"the delivery process said nothing: {self.proc.stderr.read()[-2000:]}"
        return text

    def say(self, what: str) -> None:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()

    def finish(self) -> int:
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def race(driver: str, target: str, first_outcome: str, blocked) -> tuple[list[str], list[str]]:
    """A enters once() and holds its transaction open; B starts the same key and is seen blocked
    on A (`blocked(B's pid)`); then A commits (or fails), and B finishes. Returns what each printed."""
    a, b = Delivery(driver, target, "k"), None
    try:
        seen_a = [a.line(), a.line()]                  # entering, entered 1
        b = Delivery(driver, target, "k")
        b.say("commit")                                # B leaves its block as soon as it is in it
        seen_b = [b.line()]                            # entering: B is now on its way into once()
        wait_until(lambda: blocked(b.proc.pid), 30, "B blocked on A's uncommitted marker")
        a.say(first_outcome)
        seen_b += [b.line(), b.line()]                 # entered <fresh>, done
        a_code = a.finish()
        assert b.finish() == 0
        assert (a_code == 0) == (first_outcome == "commit")
        return seen_a, seen_b
    finally:
        a.kill()
        if b:
            b.kill()


@pytest.fixture
def sqlite_target(tmp_path):
    path = str(tmp_path / "race.db")
    oncehandlers.create_effects(path)
    return path


def effects_of(driver: str, target: str) -> list:
    conn = oncehandlers.connect(driver, target)
    try:
        cur = conn.cursor()
        cur.execute("SELECT key, pid FROM effects")
        return cur.fetchall()
    finally:
        conn.close()


def in_busy_wait(pid: int) -> bool:
    """sqlite's busy handler sleeps between lock attempts: B is waiting for A's write lock."""
    try:
        return "nanosleep" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


def test_sqlite_concurrent_duplicate_waits_and_is_not_fresh(sqlite_target):
    seen_a, seen_b = race("sqlite3", sqlite_target, "commit", in_busy_wait)
    assert seen_a == ["entering", "entered 1"] and seen_b == ["entering", "entered 0", "done"]
    assert len(effects_of("sqlite3", sqlite_target)) == 1


def test_sqlite_concurrent_duplicate_runs_when_the_first_rolls_back(sqlite_target):
    seen_a, seen_b = race("sqlite3", sqlite_target, "fail", in_busy_wait)
    assert seen_b == ["entering", "entered 1", "done"]
    effects = effects_of("sqlite3", sqlite_target)
    assert len(effects) == 1


# ---------------------------------------------------------------- PostgreSQL (a real server)

@pytest.fixture(scope="module")
def postgres():
    bindir = pgserver.binaries()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries (initdb, postgres) not installed: apt-get install postgresql")
    pytest.importorskip("psycopg")
    server = pgserver.PostgresServer(bindir).start()
    yield server
    server.stop()


@pytest.fixture(params=["psycopg", "psycopg2"])
def pg(request, postgres):
    driver = request.param
    pytest.importorskip(driver)
    conn = oncehandlers.connect(driver, postgres.conninfo)
    cur = conn.cursor()
    cur.execute(f"DROP TABLE IF EXISTS effects, {TABLE}")
    cur.execute("CREATE TABLE effects (key TEXT, pid INTEGER, delivery INTEGER)")
    conn.commit()
    yield driver, postgres.conninfo, conn
    conn.close()


def test_postgres_fresh_duplicate_and_rollback(pg):
    driver, _, conn = pg
    with pytest.raises(ValueError):
        with once(job("p"), conn) as fresh:
            assert fresh
            conn.cursor().execute("INSERT INTO effects (key) VALUES (%s)", ("p",))
            raise ValueError("the body failed")
    for expected in (True, False, False):
        with once(job("p"), conn) as fresh:
            assert fresh is expected
            if fresh:
                conn.cursor().execute("INSERT INTO effects (key) VALUES (%s)", ("p",))
    cur = conn.cursor()
    cur.execute(f"SELECT (SELECT count(*) FROM effects), (SELECT count(*) FROM {TABLE})")
    assert cur.fetchone() == (1, 1)


def test_postgres_autocommit_connection(pg):
    driver, conninfo, _ = pg
    conn = oncehandlers.connect(driver, conninfo)
    conn.autocommit = True
    try:
        with pytest.raises(RuntimeError):
            with once(job("q"), conn):
                conn.cursor().execute("INSERT INTO effects (key) VALUES (%s)", ("q",))
                raise RuntimeError("boom")
        with once(job("q"), conn) as fresh:
            conn.cursor().execute("INSERT INTO effects (key) VALUES (%s)", ("q",))
        assert fresh
        cur = conn.cursor()
        cur.execute("SELECT count(*) FROM effects")
        assert cur.fetchone() == (1,)
    finally:
        conn.close()


def lock_waiters(conninfo: str, pid: int) -> bool:
    """B's backend waits on a lock (A's uncommitted marker row). B's client pid is its port's
    owner, which pg_stat_activity does not show; one waiter is all there can be here."""
    import psycopg

    with psycopg.connect(conninfo) as c:
        return c.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'").fetchone()[0] == 1


@pytest.mark.parametrize("first", ["commit", "fail"])
def test_postgres_concurrent_duplicate_blocks_on_the_uncommitted_marker(pg, first):
    driver, conninfo, _ = pg
    seen_a, seen_b = race(driver, conninfo, first, lambda pid: lock_waiters(conninfo, pid))
    assert seen_a == ["entering", "entered 1"]
    assert seen_b == ["entering", "entered 0" if first == "commit" else "entered 1", "done"]
    assert len(effects_of(driver, conninfo)) == 1


# ---------------------------------------------------------------- end to end: SIGKILL in the window

def read_effects_log(path: Path) -> list[tuple[str, int, int, int, int, str]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        event, pid, seq, delivery, fresh, key = line.split(" ", 5)
        out.append((event, int(pid), int(seq), int(delivery), int(fresh), key))
    return out


@pytest.mark.parametrize("guard", [False, True], ids=["once-only", "with-kv-guard"])
def test_sigkill_between_side_effect_and_ack_gives_each_side_effect_once(nats_server, supervisor_factory, tmp_path,
                                                                          guard):
    """300 jobs, 4 workers; workers SIGKILLed right after a job's side effect committed and before
    its handler returned (so before its ack): every job has exactly one side effect."""
    effects_db, effects_log = tmp_path / "effects.db", tmp_path / "effects.log"
    oncehandlers.create_effects(str(effects_db))
    extra = {"idempotency": {"enabled": True}} if guard else {}
    sup = supervisor_factory(nats_server, env={"EFFECTS_DB": str(effects_db), "EFFECTS_LOG": str(effects_log)},
                             workers={"count": 4, "handler": "oncehandlers:effect_once", "double_ack": guard},
                             consumer={"ack_wait": 30.0}, restart={"poison_after_crashes": 100}, **extra)
    sup.wait_ready(4)
    publish(nats_server.url, count=300, data="{i}")
    rng = random.Random(10)
    landed: list[tuple[int, int, int]] = []                 # (pid, seq, delivery) killed inside the window
    kills = 0

    def in_window() -> list[tuple[int, int, int]]:
        log = read_effects_log(effects_log)
        returned = {(p, s, d) for e, p, s, d, _, _ in log if e == "returned"}
        alive = sup.worker_pids()
        return [(p, s, d) for e, p, s, d, _, _ in log if e == "committed" and (p, s, d) not in returned and p in alive]

    while len(landed) < 12:
        victim = rng.choice(wait_until(in_window, what="a job between its side effect and its return"))
        psutil.Process(victim[0]).send_signal(signal.SIGKILL)
        kills += 1
        wait_until(lambda: victim[0] not in sup.worker_pids(), what="the victim reaped")
        # The victim's log is final now: if it never returned, the kill landed in the window.
        if not any(e == "returned" and (p, s, d) == victim for e, p, s, d, _, _ in read_effects_log(effects_log)):
            landed.append(victim)
        sup.wait_ready(4)

    def all_returned():
        return {s for e, _, s, _, _, _ in read_effects_log(effects_log) if e == "returned"} >= set(range(1, 301))
    wait_until(all_returned, timeout=120, what="every job's handler returned")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked")

    conn = sqlite3.connect(effects_db)
    per_key = Counter(key for (key,) in conn.execute("SELECT key FROM effects"))
    conn.close()
    assert sum(per_key.values()) == 300 and set(per_key) == {f"JOBS:{i}" for i in range(1, 301)}, \
        [k for k, n in per_key.items() if n > 1]
    log = read_effects_log(effects_log)
    fresh_commits = Counter(s for e, _, s, _, f, _ in log if e == "committed" and f == 1)
    assert set(fresh_commits.values()) == {1}
    for _pid, seq, delivery in landed:
        # The killed delivery was past its commit; a later delivery ran the handler again (the
        # redelivery happened) and once() found the marker: not fresh, no second side effect.
        again = [f for e, _, s, d, f, _ in log if e == "returned" and s == seq and d > delivery]
        assert again and not any(again), (seq, delivery, again)
    assert sup.status()["crosscheck"]["crashes"] == kills
    assert sup.stop() == 0


# ---------------------------------------------------------------- the demo

def test_demo_once_scenario_shows_the_guard_holding(tmp_path):
    r = run_cli("demo", "--scenario", "once", tmp=tmp_path, timeout=120)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "a publisher retry sends the same 30 ids again: 0 stored, 30 dropped by the stream as duplicates" in out, out
    assert "CRASHED (exit code 13) holding job-06 (seq 6), no ack" in out and "got job-06 again" in out, out
    assert "records.db: 30 rows for 30 jobs, each key once" in out, out
    assert re.search(r"job-06's row was written by delivery #1 \(pid \d+\), which died before its ack", out), out
    assert re.search(r"late copy of demo-\w+-6 \(seq 31\): acked as a duplicate, not run", out), out
    assert out.rstrip().splitlines()[-1].startswith("PASS"), out
    assert "Traceback" not in r.stderr
