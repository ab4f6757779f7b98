"""A throw-away PostgreSQL server for tests: initdb in a temp dir, `postgres` on a free loopback
port, trust auth, stopped and removed afterwards. PostgreSQL refuses to run as root, so as root
the server runs as an unprivileged user (`postgres` when it exists, else `nobody`)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from harness import wait_until
from natsauth import free_port


def binaries() -> Path | None:
    """The directory holding initdb and postgres (Debian keeps them out of PATH), or None."""
    found = shutil.which("initdb")
    if found and shutil.which("postgres"):
        return Path(os.path.realpath(found)).parent
    for bindir in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(f"{bindir}/initdb", os.X_OK) and os.access(f"{bindir}/postgres", os.X_OK):
            return Path(bindir)
    return None


def _unprivileged() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root and no unprivileged user (postgres, nobody) to run PostgreSQL as")


class PostgresServer:
    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="pg-test-"))     # under /tmp: the server's user must reach it
        self.user = _unprivileged()
        self.proc: subprocess.Popen | None = None

    @property
    def conninfo(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=test dbname=postgres connect_timeout=5"

    def _run_as(self) -> dict:
        return {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []} if self.user else {}

    def start(self) -> PostgresServer:
        if self.user:
            os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
        data = self.dir / "data"
        subprocess.run([str(self.bindir / "initdb"), "-D", str(data), "-U", "test", "--auth=trust", "-E", "UTF8",
                        "--no-sync"], check=True, capture_output=True, cwd=self.dir, **self._run_as())
        # The port was picked free a moment ago; any socket may take it before postgres binds it:
        # then it exits "Address already in use" and starts again on a port picked again.
        for attempt in range(1, 4):
            with open(self.dir / "postgres.log", "wb") as log:
                self.proc = subprocess.Popen(
                    [str(self.bindir / "postgres"), "-D", str(data), "-p", str(self.port), "-k", str(self.dir),
                     "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=20"],
                    stdout=subprocess.DEVNULL, stderr=log, cwd=self.dir, start_new_session=True, **self._run_as())
            try:
                wait_until(self._accepting, 60, f"postgres on {self.port}", interval=0.1)
                return self
            except AssertionError as exc:
                if attempt == 3 or "Address already in use" not in str(exc):
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _accepting(self) -> bool:
        import psycopg

        assert self.proc.poll() is None, f"postgres exited: {(self.dir / 'postgres.log').read_text()[-2000:]}"
        try:
            psycopg.connect(self.conninfo).close()
            return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)          # fast shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
