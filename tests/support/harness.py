"""Test support: a real nats-server, the real `supervisor start` in a subprocess, and the job log
written by tests/handlers/testhandlers.py. Every wait polls a condition against a deadline; nothing
sleeps to synchronise."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import psutil
import strays
import tomli_w
from natsauth import free_port, nats_server_binary

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
HANDLERS = TESTS / "handlers"   # what the suite's workers import by name (testhandlers:job, ...)
SUPPORT = TESTS / "support"
# Generous: a loaded 2-core CI box must pass every time. Waits return as soon as true.
DEADLINE = 60.0


def wait_until(predicate: Callable[[], Any], timeout: float = DEADLINE, what: str = "condition",
               interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HANDLERS), str(SUPPORT), str(REPO)])
    env.update(extra)
    return env


def popen_at_a_terminal(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """Popen for a command the test will Ctrl-C (SIGINT): started with SIGINT at its default, as
    under a terminal. A suite run in the background of a shell without job control (`pytest &`
    from a script) ignores SIGINT, as POSIX has it for background jobs, and an ignored signal
    stays ignored across fork and exec: Python then installs no KeyboardInterrupt and the child
    never sees the test's Ctrl-C. A handler (not SIG_IGN) is reset to the default at exec."""
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        return subprocess.Popen(args, **kwargs)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


# ---------------------------------------------------------------- nats-server

class NatsServer:
    """A nats-server of one test. With `auth` (the default) it takes clients with a user and
    password of its own only, and `url` carries them: a process of another test (a stray
    worker, an orphan, a test's client) that keeps reconnecting to a port this server has since
    taken over cannot bind to its stream and consumer, which every test names JOBS and
    `workers` (F17). The user names the server (strays.py reads it back from the auth errors
    the server logs). Without `auth`: a config file of the test's own (`-c`) that sets its own
    authorization, or nodes of a cluster (natscluster.py: a discovered node's URL carries no
    credentials)."""

    def __init__(self, store_dir: Path, port: int | None = None, monitor_port: int | None = None,
                 extra_args: tuple[str, ...] = (), auth: bool = True):
        self.store_dir = store_dir
        self.port = port or free_port()
        self.monitor_port = monitor_port or free_port()
        self.extra_args = extra_args
        self.user, self.password = (strays.server_user(), secrets.token_hex(8)) if auth else ("", "")
        self.proc: subprocess.Popen | None = None
        self.log_path = store_dir.parent / f"{store_dir.name}-nats-server.log"
        # Ports we picked may be taken (by any socket, an outgoing connection's included) before
        # the server binds them: picked again, but only before the first start (clients keep them).
        self.repick = port is None and monitor_port is None

    @property
    def url(self) -> str:
        """The client URL, with the server's credentials (nats-py and the supervisor take them
        from it; the supervisor's logs and /status show it without them)."""
        return self.url_at(self.port)

    def url_at(self, port: int) -> str:
        """The client URL with another port: a relay's in front of this server (stallproxy.py)."""
        userinfo = f"{self.user}:{self.password}@" if self.user else ""
        return f"nats://{userinfo}127.0.0.1:{port}"

    def start(self) -> NatsServer:
        auth = ("--user", self.user, "--pass", self.password) if self.user else ()
        for attempt in range(1, 4):
            logged = self.log_path.stat().st_size if self.log_path.exists() else 0
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [nats_server_binary(), "-js", "-sd", str(self.store_dir), "-a", "127.0.0.1", "-p", str(self.port),
                     "-m", str(self.monitor_port), *auth, *self.extra_args], stdout=subprocess.DEVNULL, stderr=log)
            try:
                wait_until(self._serving, 30, f"nats-server on {self.port}")
                break
            except AssertionError:
                said = self.log_path.read_bytes()[logged:]
                if not (self.repick and attempt < 3 and b"address already in use" in said):
                    raise AssertionError(f"nats-server on {self.port} did not start: {said[-1500:]!r}") from None
                self.port, self.monitor_port = free_port(), free_port()
        self.repick = False
        if self.user:
            strays.started(self)
        return self

    def _serving(self) -> bool:
        assert self.proc and self.proc.poll() is None, "nats-server exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true",
                                        timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.user:
            strays.stopped(self)

    def monitor(self, path: str) -> dict:
        """One of the server's monitoring endpoints (`jsz?consumers=true`, `connz?subs=1`), parsed."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/{path}", timeout=5) as r:
            return json.load(r)

    def jsz(self) -> dict:
        return self.monitor("jsz?consumers=true")

    def consumer(self, stream: str = "JOBS", name: str = "workers") -> dict:
        for account in self.jsz().get("account_details", []):
            for s in account.get("stream_detail", []):
                if s["name"] == stream:
                    for c in s.get("consumer_detail", []):
                        if c["name"] == name:
                            return c
        raise AssertionError(f"consumer {stream}/{name} not found in /jsz")

    def stream_last_seq(self, stream: str = "JOBS") -> int:
        for account in self.jsz().get("account_details", []):
            for s in account.get("stream_detail", []):
                if s["name"] == stream:
                    return s["state"]["last_seq"]
        raise AssertionError(f"stream {stream} not found in /jsz")

    def stream_msgs(self, stream: str = "JOBS") -> int:
        for account in self.jsz().get("account_details", []):
            for s in account.get("stream_detail", []):
                if s["name"] == stream:
                    return s["state"]["messages"]
        raise AssertionError(f"stream {stream} not found in /jsz")


# ---------------------------------------------------------------- the job log

@dataclass(frozen=True)
class Record:
    event: str          # start | done | raised (testhandlers:record_raises: the payload made it raise)
    pid: int
    seq: int
    delivery: int
    t: float
    data: str


@dataclass
class JobLog:
    """The job log, read incrementally: each call parses only the lines appended since the last
    (a test polling a log of tens of thousands of jobs every 20 ms re-parsed all of it each time:
    most of a core on a 2-core box, taken from the system under test). A line is taken once
    complete (its newline written: each is one O_APPEND write); a file replaced or cut is read
    again from its start."""
    path: Path
    _parsed: list[Record] = field(default_factory=list, init=False, repr=False, compare=False)
    _offset: int = field(default=0, init=False, repr=False, compare=False)
    _inode: int | None = field(default=None, init=False, repr=False, compare=False)

    def records(self) -> list[Record]:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            self._parsed, self._offset, self._inode = [], 0, None
            return []
        with f:
            st = os.fstat(f.fileno())
            if st.st_ino != self._inode or st.st_size < self._offset:
                self._parsed, self._offset, self._inode = [], 0, st.st_ino
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        for line in chunk[:end].decode().splitlines():
            event, pid, seq, delivery, t, data = line.split(" ", 5)
            self._parsed.append(Record(event, int(pid), int(seq), int(delivery), float(t), data))
        self._offset += end
        return list(self._parsed)

    def done(self) -> list[Record]:
        return [r for r in self.records() if r.event == "done"]

    def started(self) -> list[Record]:
        return [r for r in self.records() if r.event == "start"]

    def running(self) -> list[Record]:
        finished = {(r.pid, r.seq, r.delivery) for r in self.records() if r.event in ("done", "raised")}
        return [r for r in self.started() if (r.pid, r.seq, r.delivery) not in finished]

    def done_seqs(self) -> set[int]:
        return {r.seq for r in self.done()}


# ---------------------------------------------------------------- the supervisor under test

def base_config(server: NatsServer | None, tmp: Path, **sections: dict) -> dict:
    cfg: dict[str, dict] = {
        "nats": {"servers": [server.url] if server else [], "startup_timeout": 10.0},
        "embedded": {"port": 0, "monitor_port": 0, "store_dir": str(tmp / "embedded-store")},
        "workers": {"count": 2, "handler": "testhandlers:record"},
        "restart": {"backoff_initial": 0.05, "backoff_max": 1.0},
        "monitor": {"http": "127.0.0.1:0", "interval": 0.25},     # a port the supervisor binds (SupervisorProc.http)
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


class SupervisorProc:
    def __init__(self, tmp: Path, config: dict, args: tuple[str, ...] = (), env: dict | None = None):
        self.tmp = tmp
        self.config_path = tmp / "config.toml"
        self.config_path.write_text(tomli_w.dumps(config))
        self.config = config
        self.jobs = JobLog(tmp / "jobs.log")
        self.log_path = tmp / "supervisor.log"
        self.args = args
        self.env = child_env(JOBS_LOG=str(self.jobs.path), **(env or {}))
        self.proc: subprocess.Popen | None = None
        self.started: list[subprocess.Popen] = []     # every start's process (a restart's too): cleanup()
        self._log = None
        self.wrapper: tuple[str, ...] = ()      # a command the supervisor runs under (strace -f ...)
        self._http: str | None = None
        self._log_from = 0
        self._events: list[dict] = []        # _event_records: what the log held up to _events_read
        self._events_read = 0

    def start(self) -> SupervisorProc:
        self._http = None
        self._log_from = len(self.log())        # this run's lines start here (a restart appends)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([*self.wrapper, sys.executable, "-m", "supervisor", "start", "--config",
                                      str(self.config_path), *self.args], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=self.tmp, start_new_session=True)
        self.started.append(self.proc)
        return self

    # -- observing

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_log(self, pattern: str, timeout: float = DEADLINE) -> re.Match:
        def found():
            assert self.proc.poll() is None or re.search(pattern, self.log()), \
                f"supervisor exited ({self.proc.returncode}) before logging {pattern!r}:\n{self.log()[-3000:]}"
            return re.search(pattern, self.log())
        return wait_until(found, timeout, f"log line {pattern!r}")

    def events(self, kind: str | None = None, /, **match: Any) -> list[dict]:
        """The structured log events (extra={"event": ...}) of a supervisor started with
        `--log-format json`, in order; only those of `kind` whose fields equal `match`."""
        return [dict(record) for record in self._event_records() if kind in (None, record["event"])
                and all(record.get(k) == v for k, v in match.items())]

    def _event_records(self) -> list[dict]:
        """Every event record logged so far, parsing only the complete lines appended since the
        last call (tests poll these every 20 ms; a long log was parsed whole each time)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._events_read)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        self._events_read += end
        for line in chunk[:end].decode(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "event" in record:
                self._events.append(record)
        return self._events

    def wait_event(self, kind: str, /, timeout: float = DEADLINE, **match: Any) -> dict:
        def found():
            assert self.proc.poll() is None or self.events(kind, **match), \
                f"supervisor exited ({self.proc.returncode}) before event {kind} {match}:\n{self.log()[-3000:]}"
            return self.events(kind, **match)
        return wait_until(found, timeout, f"event {kind} {match}")[0]

    @property
    def http(self) -> str:
        """HOST:PORT of the supervisor's HTTP endpoint. With port 0 (the default here: a port picked
        in advance may be taken before the supervisor binds it) the one its parent bound."""
        configured = self.config["monitor"]["http"]
        if not configured.endswith(":0"):
            return configured
        if self._http is None:
            self._http = self._listening()
        if self._http is None:
            raise ConnectionRefusedError(f"the supervisor (pid {self.proc.pid}) is not listening yet")
        return self._http

    def _listening(self) -> str | None:
        """Where the parent says its HTTP endpoint listens (its `status on http://HOST:PORT` line,
        text or JSON). Not its listening sockets: a handler module it imports may open others."""
        m = re.search(r"status on http://([^\s/]+:\d+)", self.log()[self._log_from:])
        return m.group(1) if m else None

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://{self.http}/status", timeout=5) as r:
            return json.load(r)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.http}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def try_status(self) -> dict | None:
        try:
            return self.status()
        except OSError:
            return None

    def workers(self) -> list[psutil.Process]:
        """Direct children that are workers (the embedded nats-server excluded)."""
        return [c for c in children_of(self.proc.pid) if "nats-server" not in " ".join(_cmdline(c))]

    def worker_pids(self) -> set[int]:
        return {p.pid for p in self.workers()}

    def wait_ready(self, n: int | None = None, timeout: float = DEADLINE) -> dict:
        n = self.config["workers"]["count"] if n is None else n

        def ready():
            s = self.try_status()
            return s if s and sum(w["state"] == "ready" for w in s["workers"]["list"]) == n \
                and s["workers"]["alive"] == n else None
        return wait_until(ready, timeout, f"{n} ready workers")

    # -- acting

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = DEADLINE) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"supervisor still running after {timeout:g}s:\n{self.log()[-3000:]}") from None

    def stop(self, timeout: float = DEADLINE) -> int:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def cleanup(self) -> None:
        """Never leave a process behind, whatever the test did: the process group of every
        start (a restarted supervisor's earlier workers and orphans too)."""
        for proc in self.started:
            kill_group(proc)
        if self._log:
            self._log.close()


def alive(p: psutil.Process) -> bool:
    """Running and not a zombie (one that ends between the two looks is gone, not an error)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def children_of(pid: int) -> list[psutil.Process]:
    """A process's direct children, from the kernel's list of each of its threads' children:
    psutil's children() reads every process on the box (12 ms with ~100 of them, and tests poll
    this every 20 ms). psutil's way where the kernel keeps no such list (or the process is gone)."""
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        try:
            return psutil.Process(pid).children()
        except psutil.NoSuchProcess:
            return []
    out = []
    for task in _listdir(f"/proc/{pid}/task"):
        for child in _read(f"/proc/{pid}/task/{task}/children").split():
            with contextlib.suppress(psutil.NoSuchProcess):
                out.append(psutil.Process(int(child)))
    return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:            # the process ended meanwhile
        return []


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:            # a thread that ended meanwhile
        return ""


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _in_group(p: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(p.pid) == pgid
    except OSError:
        return False


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process started in a session of its own and whatever is left in its group (its
    workers stay there when it dies). Its pid names the group only while it is ours: the kernel
    gives a pid out again once no process has it as pid or group (pid_max is 32768 here, and a
    suite run goes round it), so after the process was reaped a live process with its pid is
    another test's, and nothing of ours is left in its group."""
    if proc.returncode is None or not psutil.pid_exists(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)     # at once: a worker forked meanwhile is in the group too
    if proc.returncode is None:
        proc.wait()


def run_cli(*args: str, tmp: Path | None = None, env: dict | None = None, timeout: float = DEADLINE,
            stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True, text=True,
                          env=child_env(**(env or {})), cwd=tmp, timeout=timeout, input=stdin)


def publish(server_url: str, *, count: int, data: str = "0", tmp: Path | None = None, extra: tuple = ()) -> str:
    """`supervisor publish` (it provisions the stream, as `start` would); its stdout. Run in this
    process, through the command's own code: a Python start-up and the command's imports per call
    cost a second or more on a loaded box. A working directory `tmp` without a config.toml is a
    config of defaults, given as an empty file. As a subprocess (as before) where this process
    would differ: a config.toml in `tmp` or a --config (it may turn tracing on, or name files
    relative to `tmp`), SUPERVISOR_* keys in the environment (the subprocess drops them). Tests
    of the CLI itself run it with run_cli."""
    argv = ("publish", "--server", server_url, "--count", str(count), "--data", data, *extra)
    if "--config" in extra or (tmp is not None and (tmp / "config.toml").exists()) \
            or any(k.startswith("SUPERVISOR_") for k in os.environ):
        r = run_cli(*argv, tmp=tmp)
        assert r.returncode == 0, r.stderr
        return r.stdout
    from supervisor.cli.main import COMMANDS, parse

    if tmp is not None:                  # not this process's ./config.toml: none, as in `tmp`
        argv = (*argv, "--config", str(empty_config()))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = COMMANDS["publish"](parse(list(argv)))
    assert rc == 0, out.getvalue()
    return out.getvalue()


def empty_config() -> Path:
    """An empty config file (defaults, as no file at all) in the session's temp dir."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "jss-empty-config.toml"
    if not path.exists():
        path.write_text("")
    return path


def publish_now(server_url: str, *, count: int, data: str = "0", subject: str = "jobs.new") -> list[int]:
    """Store `count` jobs from this process: no CLI start-up (half a second idle, more on a loaded
    box) between the call and the jobs, where a test's timing depends on it. Their stream seqs."""
    async def run() -> list[int]:
        nc = await nats.connect(server_url)
        try:
            js = nc.jetstream()
            return [(await js.publish(subject, data.encode())).seq for _ in range(count)]
        finally:
            await nc.close()
    return asyncio.run(run())


def backlog_of(server_url: str, *, fast: int, count: int, data: str) -> list[int]:
    """Store `fast` no-op jobs, then `count` jobs of `data`, before any worker runs (the CLI's
    publish provisions the stream): the workers start on a backlog, learn their jobs are fast,
    and so pull batches that hold the later jobs unstarted behind a running one, on a loaded box
    too (without a backlog a worker takes only what it can start until the fleet has seen
    KNOWN_JOBS jobs, workers/runtime/pulls.py). The later jobs' stream seqs."""
    publish(server_url, count=fast, data="0")
    return publish_now(server_url, count=count, data=data)


def dead_letter_headers(server_url: str, stream: str = "JOBS_DLQ") -> list[dict[str, str]]:
    """The headers of every message in the dead-letter stream, oldest first."""
    async def run() -> list[dict[str, str]]:
        nc = await nats.connect(server_url)
        try:
            js = nc.jetstream()
            state = (await js.stream_info(stream)).state
            if not state.messages:
                return []
            seqs = range(state.first_seq, state.last_seq + 1)
            return [dict((await js.get_msg(stream, seq)).headers or {}) for seq in seqs]
        finally:
            await nc.close()
    return asyncio.run(run())
