"""Starting, watching and stopping the contenders' processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import tomli_w

from .natsenv import child_env, dies_with_the_bench, wait_until


def _popen(argv: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env or child_env(),
                                start_new_session=True, preexec_fn=dies_with_the_bench())


def _group_kill(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM each process group, then SIGKILL whatever is left after `timeout`."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)      # the group: stray children too
        if p.poll() is None:
            p.wait()


@dataclass
class Contender:
    """One contender's processes for one run."""
    name: str
    workdir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    started: int = 0

    def top_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def tree(self) -> list[psutil.Process]:
        out = []
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                top = psutil.Process(p.pid)
                out.append(top)
                out.extend(top.children(recursive=True))
        return out

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def log_tail(self, chars: int = 3000) -> str:
        text = "".join(f.read_text(errors="replace") for f in sorted(self.workdir.glob("*.log")))
        return text[-chars:]

    def stop(self, timeout: float = 10.0) -> None:
        _group_kill(self.procs, timeout)


# ---------------------------------------------------------------- the baselines

def start_loops(mode: str, n: int, url: str, workdir: Path, batch: int = 256, env: dict | None = None) -> Contender:
    """n loop processes in one session, as a supervisor's workers are: on a busy box the kernel's
    autogroup scheduler shares the CPU between sessions, not processes, so n sessions would get
    n shares where the supervisor gets one (`bench.contenders --launch n` starts them)."""
    c = Contender(mode, workdir)
    c.procs.append(_popen([sys.executable, "-m", "bench.contenders", mode, "--server", url, "--batch", str(batch),
                           "--launch", str(n)], workdir, workdir / f"{mode}.log", child_env(**(env or {}))))
    c.started += n
    return c


def loop_pids(c: Contender) -> list[int]:
    """The loop processes themselves (not their launcher)."""
    return [p.pid for p in c.tree() if p.pid not in c.top_pids()]


def run_bare(n: int, rounds: int, count: int, workdir: Path) -> float:
    """n processes each spinning `count` jobs of `rounds`; jobs/s over the slowest one's own
    timing (interpreter start-up left out; they start within milliseconds of each other)."""
    argv = [sys.executable, "-m", "bench.contenders", "bare", "--rounds", str(rounds), "--count", str(count)]
    ps = [subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE, text=True, env=child_env(),
                           preexec_fn=dies_with_the_bench()) for _ in range(n)]
    try:
        wait_until(lambda: all(p.poll() is not None for p in ps), 600, "the bare spin processes", 0.05)
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
    outs = [p.communicate()[0] for p in ps]
    if any(p.returncode for p in ps):
        raise RuntimeError(f"bare spin processes failed: {[p.returncode for p in ps]}")
    return n * count / max(float(o) for o in outs)


def faststream_available() -> bool:
    """FastStream with its CLI extra (typer), whose `faststream` command sits next to python."""
    import importlib.util
    if not (importlib.util.find_spec("faststream") and importlib.util.find_spec("typer")):
        return False
    return shutil.which("faststream", path=str(Path(sys.executable).parent)) is not None


def start_faststream(n: int, url: str, workdir: Path, batch: int = 256, env: dict | None = None) -> Contender:
    exe = str(Path(sys.executable).with_name("faststream"))
    c = Contender("faststream", workdir)
    c.procs.append(_popen([exe, "run", "bench.fs_app:app", "--workers", str(n)], workdir, workdir / "faststream.log",
                          child_env(BENCH_NATS_URL=url, BENCH_BATCH=str(batch), **(env or {}))))
    return c


# ---------------------------------------------------------------- ours

@dataclass
class Supervisor(Contender):
    http: str = ""                  # HOST:PORT of its HTTP endpoint, once its log names it
    config: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    def bound_http(self) -> str:
        """Where its HTTP endpoint listens, from its own `status on http://HOST:PORT` line: it binds
        port 0, as a port picked here in advance may be taken (by any socket) before it binds it."""
        m = not self.http and re.search(r"status on http://([^\s/]+):(\d+)",
                                        (self.workdir / "supervisor.log").read_text(errors="replace"))
        if m:
            host, port = m.groups()
            if port == "0":         # a --product tree older than port 0's support logs ":0": ask its socket
                with contextlib.suppress(psutil.Error):
                    port = next((str(c.laddr.port) for c in psutil.Process(self.pid).net_connections()
                                 if c.status == psutil.CONN_LISTEN), "0")
            self.http = f"{host}:{port}" if port != "0" else ""
        return self.http

    def status(self) -> dict | None:
        if not self.bound_http():
            return None
        try:
            with urllib.request.urlopen(f"http://{self.http}/status", timeout=5) as r:
                return json.load(r)
        except (OSError, ValueError):
            return None

    def ready(self, n: int) -> dict | None:
        s = self.status()
        if s and s["workers"]["alive"] == n and sum(w["state"] == "ready" for w in s["workers"]["list"]) == n:
            return s
        return None

    def wait_ready(self, n: int, timeout: float = 60.0) -> dict:
        def check():
            if not self.alive():
                raise RuntimeError(f"supervisor exited ({self.procs[0].returncode}):\n{self.log_tail()}")
            return self.ready(n)
        return wait_until(check, timeout, f"{n} ready workers", 0.02)

    def worker_pids(self) -> list[int]:
        with contextlib.suppress(psutil.Error):
            return [c.pid for c in psutil.Process(self.pid).children() if "nats-server" not in c.name()]
        return []

    def stop(self, timeout: float = 30.0) -> None:
        _group_kill(self.procs, timeout)


def supervisor_config(url: str, n: int, handler: str, **sections: dict[str, Any]) -> dict:
    """`supervisor start`'s config: every key at its default but the server, the worker count, the
    handler and HTTP on a port the supervisor binds (port 0; Supervisor.bound_http finds it);
    `sections` add keys ({"workers": {"batch": 1024}, ...})."""
    config: dict[str, dict[str, Any]] = {
        "nats": {"servers": [url], "startup_timeout": 10.0},
        "workers": {"count": n, "handler": handler},
        "monitor": {"http": "127.0.0.1:0"},
    }
    for section, keys in sections.items():
        config.setdefault(section, {}).update(keys)
    return config


def start_supervisor(name: str, config: dict, workdir: Path, env: dict | None = None) -> Supervisor:
    path = workdir / "config.toml"
    path.write_text(tomli_w.dumps(config))
    c = Supervisor(name, workdir, config=config)
    c.procs.append(_popen([sys.executable, "-m", "supervisor", "start", "--config", str(path)], workdir,
                          workdir / "supervisor.log", child_env(**(env or {}))))
    return c
