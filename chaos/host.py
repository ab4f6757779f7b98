"""Faults that need the host's help: cgroups (a memory limit the kernel OOM-kills at; a task
limit that makes fork() fail with EAGAIN, as systemd's TasksMax does) and a small tmpfs that
fills up under a nats-server's file store.

Each needs root (or a delegated cgroup); `why_not_*` says plainly why a fault cannot be
simulated on this machine, and the scenario is then reported as skipped, not passed.
As root, RLIMIT_NPROC does not apply (the kernel exempts uid 0), so fork failure is simulated
with the pids controller instead: the same EAGAIN a supervisor under TasksMax gets.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

CGROUP_V1 = Path("/sys/fs/cgroup")


def why_not_cgroup(controller: str) -> str:
    if os.geteuid() != 0:
        return f"needs root to create a {controller} cgroup"
    if not (CGROUP_V1 / controller / "cgroup.procs").exists():
        return f"no cgroup v1 {controller} controller at {CGROUP_V1 / controller}"
    return ""


def make_cgroup(controller: str, name: str) -> Path:
    path = CGROUP_V1 / controller / f"jschaos-{os.getpid()}-{name}"
    path.mkdir()
    return path


def remove_cgroup(path: Path, timeout: float = 10.0) -> None:
    """rmdir once its processes are gone; anything still inside goes back to the parent group."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                for pid in (path / "cgroup.procs").read_text().split():
                    (path.parent / "cgroup.procs").write_text(pid)
                path.rmdir()
                return
        time.sleep(0.05)


def join_cgroup(path: Path, pids: list[int]) -> None:
    for pid in pids:
        (path / "cgroup.procs").write_text(str(pid))


def why_not_tmpfs() -> str:
    if os.geteuid() != 0:
        return "needs root to mount a small tmpfs under the file store"
    return ""


def mount_tmpfs(path: Path, megabytes: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)], check=True,
                   capture_output=True)


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def fill(path: Path) -> Path:
    """Write zeros to `path` until the file system says ENOSPC; returns the filler to delete."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 64):          # down to the last few bytes
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    return filler
