"""sd_notify: exact datagrams on a real AF_UNIX socket standing in for systemd's."""

from __future__ import annotations

import logging
import os
import re
import socket
import tempfile
import time
import uuid

import pytest

from supervisor.parent import systemd as notify
from supervisor.parent.systemd import Notifier
from workers.protocol.fork import scrub_child_env


class FakeSystemd:
    """A bound SOCK_DGRAM socket playing systemd's NOTIFY_SOCKET."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind(address)
        self.sock.settimeout(2.0)

    def recv(self) -> str:
        return self.sock.recv(4096).decode()

    def assert_empty(self) -> None:
        self.sock.setblocking(False)
        try:
            with pytest.raises(BlockingIOError):
                self.sock.recv(4096)
        finally:
            self.sock.settimeout(2.0)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def sockdir():
    # Short path on purpose: sun_path holds at most 107 bytes, pytest's tmp_path can exceed it.
    with tempfile.TemporaryDirectory(prefix="sdn-") as path:
        yield path


@pytest.fixture
def systemd(sockdir):
    path = os.path.join(sockdir, "notify")
    fake = FakeSystemd(path)
    fake.path = path
    yield fake
    fake.close()


def env_for(path: str, **extra: str) -> dict[str, str]:
    return {"NOTIFY_SOCKET": path, **extra}


def test_ready_with_and_without_status(systemd):
    n = Notifier(env_for(systemd.path))
    assert n.enabled
    assert n.ready("4 workers ready")
    assert systemd.recv() == "READY=1\nSTATUS=4 workers ready"
    assert n.ready()
    assert systemd.recv() == "READY=1"


def test_status_stopping_watchdog_extend(systemd):
    n = Notifier(env_for(systemd.path, WATCHDOG_USEC="30000000"))
    n.status("draining: 3 jobs in flight")
    assert systemd.recv() == "STATUS=draining: 3 jobs in flight"
    n.stopping()
    assert systemd.recv() == "STOPPING=1"
    n.watchdog()
    assert systemd.recv() == "WATCHDOG=1"
    n.extend_timeout(12.5)
    assert systemd.recv() == "EXTEND_TIMEOUT_USEC=12500000"
    n.extend_timeout(-1)
    assert systemd.recv() == "EXTEND_TIMEOUT_USEC=0"


def test_status_newlines_cannot_inject_keys(systemd):
    Notifier(env_for(systemd.path)).status("line one\nREADY=1")
    assert systemd.recv() == "STATUS=line one READY=1"


def test_reloading_carries_monotonic_usec(systemd):
    n = Notifier(env_for(systemd.path))
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert n.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    m = re.fullmatch(r"RELOADING=1\nMONOTONIC_USEC=(\d+)", systemd.recv())
    assert m, "unexpected datagram"
    assert before <= int(m.group(1)) <= after


def test_abstract_namespace_socket():
    name = f"jss-notify-test-{uuid.uuid4().hex}"
    fake = FakeSystemd("\0" + name)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.enabled
        assert n.ready("up")
        assert fake.recv() == "READY=1\nSTATUS=up"
    finally:
        fake.close()


def test_watchdog_interval_is_half_of_watchdog_usec(systemd):
    n = Notifier(env_for(systemd.path, WATCHDOG_USEC="30000000", WATCHDOG_PID=str(os.getpid())))
    assert n.watchdog_interval == 15.0
    assert n.watchdog()
    assert systemd.recv() == "WATCHDOG=1"


def test_watchdog_pid_mismatch_disables_watchdog(systemd):
    n = Notifier(env_for(systemd.path, WATCHDOG_USEC="30000000",
                         WATCHDOG_PID=str(os.getpid() + 1)))
    assert n.watchdog_interval is None
    assert n.watchdog() is False
    systemd.assert_empty()
    assert n.ready()  # only the watchdog is someone else's; notify itself still works
    assert systemd.recv() == "READY=1"


@pytest.mark.parametrize("usec", [None, "", "0", "-5", "soon"])
def test_no_or_bad_watchdog_usec_means_no_watchdog(systemd, usec):
    env = env_for(systemd.path) if usec is None else env_for(systemd.path, WATCHDOG_USEC=usec)
    n = Notifier(env)
    assert n.watchdog_interval is None
    assert n.watchdog() is False
    systemd.assert_empty()


def test_no_socket_is_a_noop(monkeypatch):
    made = []
    monkeypatch.setattr(notify.socket, "socket", lambda *a, **k: made.append(a))
    n = Notifier({"WATCHDOG_USEC": "30000000"})
    assert not n.enabled
    assert n.watchdog_interval is None
    for call in (n.ready, n.reloading, n.stopping, n.watchdog):
        assert call() is False
    assert n.status("x") is False and n.extend_timeout(1) is False
    assert made == []


@pytest.mark.parametrize("value", ["relative/notify", "vsock:2:1234", "@"])
def test_unusable_address_disables(value, caplog):
    with caplog.at_level(logging.WARNING, logger="supervisor.notify"):
        n = Notifier({"NOTIFY_SOCKET": value})
    assert not n.enabled
    assert n.ready() is False
    assert len(caplog.records) == 1


def test_default_environ_is_os_environ(systemd, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", systemd.path)
    Notifier().ready()
    assert systemd.recv() == "READY=1"


def test_socket_path_gone_never_raises_and_warns_once(systemd, caplog):
    n = Notifier(env_for(systemd.path, WATCHDOG_USEC="2000000"))
    systemd.close()
    os.unlink(systemd.path)
    with caplog.at_level(logging.DEBUG, logger="supervisor.notify"):
        assert n.ready("x") is False
        assert n.watchdog() is False
        assert n.stopping() is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "ENOENT" in warnings[0].getMessage()


def test_socket_nobody_listening_never_raises(sockdir, caplog):
    path = os.path.join(sockdir, "stale")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(path)
    stale.close()  # the file stays, nobody reads it: ECONNREFUSED
    with caplog.at_level(logging.WARNING, logger="supervisor.notify"):
        n = Notifier(env_for(path))
        assert n.ready() is False
        assert n.status("again") is False
    assert len(caplog.records) == 1


def test_full_receiver_does_not_block(sockdir):
    path = os.path.join(sockdir, "full")
    fake = FakeSystemd(path)  # never read: its queue fills up
    try:
        n = Notifier(env_for(path))
        start = time.monotonic()
        results = [n.status("x" * 1024) for _ in range(2000)]
        assert time.monotonic() - start < 5.0
        assert results[0] is True and results[-1] is False
    finally:
        fake.close()


def test_socket_is_cloexec_nonblocking_and_not_kept_open(systemd, monkeypatch):
    types = []
    real_socket = socket.socket

    def recording_socket(family=-1, type=-1, *args, **kwargs):
        types.append(type)
        return real_socket(family, type, *args, **kwargs)

    n = Notifier(env_for(systemd.path))
    fds_before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(notify.socket, "socket", recording_socket)
    n.ready()
    monkeypatch.undo()
    assert systemd.recv() == "READY=1"
    assert len(types) == 1
    assert types[0] & socket.SOCK_CLOEXEC and types[0] & socket.SOCK_NONBLOCK
    assert set(os.listdir("/proc/self/fd")) == fds_before  # nothing left for a fork to inherit


def test_forked_child_stays_silent(systemd):
    n = Notifier(env_for(systemd.path, WATCHDOG_USEC="30000000"))
    pid = os.fork()
    if pid == 0:  # child: every call must be a no-op; report through the exit status
        sent = n.ready("child") or n.watchdog() or n.enabled
        os._exit(1 if sent else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    systemd.assert_empty()
    assert n.ready()
    assert systemd.recv() == "READY=1"


def test_scrub_child_env_removes_notify_and_watchdog_vars():
    env = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000",
           "WATCHDOG_PID": "1", "PATH": "/usr/bin", "JOURNAL_STREAM": "8:123"}
    assert scrub_child_env(env) is env
    assert env == {"PATH": "/usr/bin", "JOURNAL_STREAM": "8:123"}
    assert scrub_child_env({}) == {}


def test_scrub_child_env_unsets_in_the_process(monkeypatch, systemd):
    monkeypatch.setenv("NOTIFY_SOCKET", systemd.path)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    scrub_child_env(os.environ)
    assert "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ
    assert not Notifier().enabled
