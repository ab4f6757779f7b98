"""systemd readiness / watchdog notifications (sd_notify) with the stdlib only.

The protocol is one datagram of ``KEY=VALUE`` lines sent to the AF_UNIX socket named by
``$NOTIFY_SOCKET``: a filesystem path, or an abstract-namespace name when it starts with ``@``
(see sd_notify(3)). Outside systemd the variable is unset and every method is a cheap no-op.

Choices, and why:

- A fresh SOCK_DGRAM socket per message, closed at once (as libsystemd does). Messages are rare
  (ready, a status line, a watchdog ping every WATCHDOG_USEC/2), so the extra syscall is free, and
  no notify fd exists between sends that a forked worker could inherit. SOCK_CLOEXEC covers the
  window during a send for exec'd children (the embedded nats-server); SOCK_NONBLOCK means a
  stalled or full receiver drops the message instead of stalling the supervisor's event loop.
- Sending never raises: notification is advisory, so a missing or refusing socket is logged once
  as a warning and then ignored.
- The notifier stays silent in any process other than the one that built it. With
  ``NotifyAccess=main`` systemd would ignore a forked worker's messages anyway, but a worker that
  kept sending WATCHDOG=1 through an inherited object would hide a hung parent under a looser
  setting. Workers should also drop the variables themselves: see :func:`workers.protocol.fork.scrub_child_env`.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger("supervisor.notify")

def _socket_address(value: str) -> str | None:
    """Map a NOTIFY_SOCKET value to an AF_UNIX address, or None when it is not one we can use."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]  # abstract namespace: leading NUL, no terminating NUL
    if value.startswith("/"):
        return value
    return None  # relative paths are invalid for sd_notify; "vsock:" (systemd 254+) unsupported


def _watchdog_usec(environ: Mapping[str, str], pid: int) -> int | None:
    """WATCHDOG_USEC when it is meant for this process (sd_watchdog_enabled(3) rules), else None."""
    raw_pid = environ.get("WATCHDOG_PID")
    if raw_pid is not None:
        try:
            if int(raw_pid) != pid:
                return None  # set for another process (e.g. we are a child that inherited it)
        except ValueError:
            return None
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec if usec > 0 else None


class Notifier:
    """Talks to systemd's notify socket; does nothing when not run under ``Type=notify``."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._pid = os.getpid()
        raw = env.get("NOTIFY_SOCKET", "")
        self._address = _socket_address(raw) if raw else None
        self._warned = False
        if raw and self._address is None:
            self._warn_once("NOTIFY_SOCKET=%r is not an absolute path or @abstract name; "
                            "systemd notifications disabled", raw)
        usec = _watchdog_usec(env, self._pid)
        self._watchdog_usec = usec if self._address is not None else None

    @property
    def enabled(self) -> bool:
        """True when there is a notify socket to talk to (from this process)."""
        return self._address is not None and os.getpid() == self._pid

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between ``watchdog()`` pings (half of WATCHDOG_USEC), or None if no watchdog."""
        if self._watchdog_usec is None or not self.enabled:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def ready(self, status: str | None = None) -> bool:
        """Startup (or a reload) is complete; systemd moves the unit to active."""
        return self._send("READY=1", *self._status_line(status))

    def reloading(self) -> bool:
        """A reload began; send ``ready()`` when it is done.

        MONOTONIC_USEC is required by systemd >= 253 for ``Type=notify-reload`` to tie the
        message to this reload request; older versions ignore the extra field.
        """
        now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self._send("RELOADING=1", f"MONOTONIC_USEC={now_usec}")

    def stopping(self) -> bool:
        """Shutdown began (draining); systemd shows the unit as deactivating."""
        return self._send("STOPPING=1")

    def status(self, text: str) -> bool:
        """A one-line free-form status, shown by ``systemctl status``."""
        return self._send(*self._status_line(text))

    def watchdog(self) -> bool:
        """Keep-alive ping; a no-op unless the watchdog is enabled for this process."""
        if self.watchdog_interval is None:
            return False
        return self._send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the start/stop timeout fires (e.g. while draining).

        Each call sets a new deadline from now; it cannot lengthen beyond what is asked, so
        call it again before the previous extension runs out.
        """
        usec = max(0, int(seconds * 1_000_000))
        return self._send(f"EXTEND_TIMEOUT_USEC={usec}")

    @staticmethod
    def _status_line(text: str | None) -> tuple[str, ...]:
        if text is None:
            return ()
        # One message is newline-separated assignments: a newline would start a bogus key.
        return ("STATUS=" + " ".join(str(text).splitlines()),)

    def _send(self, *lines: str) -> bool:
        """Send one datagram; True when it was handed to the socket. Never raises."""
        if not lines or not self.enabled or self._address is None:
            return False
        payload = "\n".join(lines).encode("utf-8", "replace")
        try:
            sock = socket.socket(socket.AF_UNIX,
                                 socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        except OSError as exc:
            self._warn_once("cannot create a socket for systemd notify: %s", exc)
            return False
        try:
            sock.sendto(payload, self._address)
        except OSError as exc:
            # ENOENT: socket gone; ECONNREFUSED: nobody bound; EAGAIN: receiver queue full.
            reason = errno.errorcode.get(exc.errno or 0, str(exc))
            self._warn_once("systemd notify to %s failed (%s); further failures are not logged",
                            self._printable_address(), reason)
            return False
        finally:
            sock.close()
        return True

    def _printable_address(self) -> str:
        address = self._address or ""
        return "@" + address[1:] if address.startswith("\0") else address

    def _warn_once(self, message: str, *args: object) -> None:
        if self._warned:
            log.debug(message, *args)
            return
        self._warned = True
        log.warning(message, *args)
