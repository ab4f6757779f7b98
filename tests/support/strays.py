"""Test support: strays, the processes and clients of a test that outlive it (F17,
docs/RELIABILITY.md). A stray that reconnects to a port another test's nats-server has since
taken over would bind to that test's consumer (every test names its stream JOBS and its
consumer `workers`) and take its jobs outside the test's ledger.

Every harness nats-server (harness.NatsServer) takes clients with a user and password of its
own; the user is named here, `<xdist worker>-<pid>-<n>`, and the session's record says which
test started that server on which port. A stray holds the credentials of the server it was
started against, so the server now on that port refuses it and logs `authentication error -
User "<that server's user>"`. At each stop the server's log is read for those lines: each names
the test whose process knocked.

And at each test's teardown, once its fixtures are gone: the processes still running in its
temp dir (every supervisor the harness starts runs there, its workers and orphans too), and the
threads it left in the test process (a test's own client on a loop of its own).

The record is one file per session (JSS_TEST_STRAYS, set by tests/conftest.py), shared by the
xdist workers, one JSON object a line (each one short write: the workers' lines do not mix);
`summary` reads it for the session's terminal summary. Without the variable nothing is recorded.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

RECORD = "JSS_TEST_STRAYS"
GRACE = 2.0                 # a process of the test's still running this long after its teardown is a stray
_serial = itertools.count(1)
_read: dict[Path, int] = {}       # each server log's offset already read for refusals
KNOCK = re.compile(rb"^\[\d+\] (\S+ \S+) \[ERR\] (\S+) - cid:\d+ - authentication error(?: - User \"([^\"]*)\")?",
                   re.MULTILINE)


def server_user() -> str:
    """A user name of its own for a test's server: unique in the session, and it says whose it is."""
    return f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}-{next(_serial)}"


def current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or "(no test)"


def _write(entry: dict[str, Any]) -> None:
    path = os.environ.get(RECORD)
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(entry, separators=(",", ":")) + "\n")


def started(server: Any) -> None:
    """A server is up (its first start, or a restart on the same port)."""
    _write({"kind": "server", "user": server.user, "port": server.port, "test": current_test(), "t": time.time()})


def stopped(server: Any) -> None:
    """A server stopped: the connections it refused for want of its credentials since the last look."""
    path = Path(server.log_path)
    try:
        with open(path, "rb") as f:
            f.seek(_read.get(path, 0))
            chunk = f.read()
    except FileNotFoundError:
        return
    _read[path] = _read.get(path, 0) + len(chunk)
    knocks = [(m.group(1).decode(), m.group(2).decode(), (m.group(3) or b"").decode()) for m in KNOCK.finditer(chunk)]
    if knocks:
        _write({"kind": "knocks", "user": server.user, "port": server.port, "test": current_test(),
                "by": dict(Counter(user or "(no user)" for _, _, user in knocks)),
                "first": knocks[0][0], "last": knocks[-1][0], "from": sorted({peer for _, peer, _ in knocks})[:10]})


# ---------------------------------------------------------------- at a test's teardown

class Before:
    """What ran before a test's setup: its threads, and this process's children."""

    def __init__(self) -> None:
        self.threads = set(threading.enumerate())
        self.children = children()


def outlived(test: str, tmp: Path | None, before: Before) -> None:
    """Record what the test left running once its fixtures are torn down, still there GRACE
    seconds on: processes in its temp dir (cleanup kills by process group: a process out of it
    is missed; an orphan is no child of ours), children of this process started since its
    setup (a publisher it started), and the threads it started that still run. Read from /proc
    directly: a millisecond, where psutil took 50 (it runs at every test's teardown)."""
    left = [t for t in threading.enumerate() if t not in before.threads and t.is_alive()]
    if left:
        _write({"kind": "threads", "test": test, "threads": sorted(f"{t.name} daemon={t.daemon}" for t in left)})
    deadline = time.monotonic() + GRACE
    while (pids := of_the_test(tmp, before.children)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pids:
        _write({"kind": "processes", "test": test, "processes": [describe(pid) for pid in sorted(pids)]})


def of_the_test(tmp: Path | None, old_children: set[int]) -> set[int]:
    found = {pid for pid in children() - old_children if alive(pid)}
    if tmp is not None:
        where = str(tmp)
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                with contextlib.suppress(OSError):
                    cwd = os.readlink(f"/proc/{entry}/cwd")
                    if (cwd == where or cwd.startswith(where + "/")) and alive(int(entry)):
                        found.add(int(entry))
    return found


def children() -> set[int]:
    """This process's children (the kernel's list per thread: a thread's Popen is its child)."""
    out: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
            out.update(int(pid) for pid in f.read().split())
    return out


def alive(pid: int) -> bool:
    """Running, not a zombie (killed and not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def describe(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return (f"pid {pid} (ppid {p.ppid()}, pgid {os.getpgid(pid)}, {time.time() - p.create_time():.0f}s old): "
                f"{' '.join(p.cmdline())[:200]}")
    except (psutil.Error, OSError):
        return f"pid {pid} (gone)"


# ---------------------------------------------------------------- the session's summary

def summary(path: Path) -> list[str]:
    """What the session's record says, one line each: refused strays, left processes and threads."""
    try:
        entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []
    whose = {e["user"]: e for e in entries if e["kind"] == "server"}
    out = []
    for e in entries:
        if e["kind"] == "knocks":
            by = ", ".join(f"{n} from {u} ({whose[u]['test']}, port {whose[u]['port']})" if u in whose else f"{n} from {u}"
                           for u, n in e["by"].items())
            out.append(f"refused by the server of {e['test']} (port {e['port']}, {e['first']} to {e['last']}): {by}")
        elif e["kind"] == "processes":
            out += [f"left running by {e['test']}: {p}" for p in e["processes"]]
        elif e["kind"] == "threads":
            out.append(f"threads left by {e['test']}: {', '.join(e['threads'])}")
    return out
