"""Process hygiene across fork(): what a child sheds and what it asks of the kernel. Used by the
workers and by every process the supervisor starts (the embedded nats-server, the demos)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import MutableMapping

PR_SET_PDEATHSIG = 1

#: The variables systemd hands to the main process only; a child must not inherit them.
CHILD_SCRUBBED_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def scrub_child_env(environ: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Remove the systemd notify/watchdog variables from ``environ`` in place and return it.

    Call it in a worker right after fork (with ``os.environ``: ``pop`` also unsets the variable
    at the C level), and on the copy of the environment given to an exec'd child, so nothing
    but the supervisor itself ever talks to systemd's notify socket.
    """
    for name in CHILD_SCRUBBED_VARS:
        environ.pop(name, None)
    return environ


def set_parent_death_signal(sig: int) -> None:
    """Linux delivers `sig` to this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def neutralise_inherited_fds(keep: set[int]) -> None:
    """Point every inherited descriptor at /dev/null instead of closing it.

    That releases the parent's sockets (its NATS connection above all: a child holding it keeps
    the parent's connection open on the server) while keeping the numbers taken, so an
    inherited object that closes "its" fd later can never close one of ours.
    """
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep or fd == devnull:
            continue
        try:
            os.dup2(devnull, fd, inheritable=False)
        except OSError:
            pass                              # the listing's own directory fd, already gone
    os.close(devnull)
