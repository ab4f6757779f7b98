"""Operations (issue 5): sd_notify, reload and scaling by signal, SIGQUIT. Real processes, a real
nats-server, and a fake NOTIFY_SOCKET the test reads."""

import signal
import socket
import time

import psutil
import tomli_w

from harness import publish, wait_until


class FakeSystemd:
    """A unix datagram socket standing in for systemd's notify socket."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)
        self.messages: list[tuple[float, dict]] = []

    def read(self) -> list[tuple[float, dict]]:
        while True:
            try:
                data = self.sock.recv(4096).decode()
            except BlockingIOError:
                return self.messages
            fields = dict(line.split("=", 1) for line in data.splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))

    def kinds(self) -> list[str]:
        out = []
        for _, fields in self.read():
            for key in ("READY", "RELOADING", "STOPPING", "WATCHDOG"):
                if key in fields:
                    out.append(key)
            if set(fields) == {"STATUS"}:
                out.append("STATUS")
        return out

    def close(self):
        self.sock.close()


def test_sd_notify_sequence(nats_server, supervisor_factory, tmp_path):
    systemd = FakeSystemd(tmp_path / "notify.sock")
    sup = supervisor_factory(nats_server, workers={"count": 1}, restart={"backoff_initial": 3.0, "backoff_max": 3.0},
                             env={"NOTIFY_SOCKET": systemd.path, "WATCHDOG_USEC": "2000000"})
    try:
        wait_until(lambda: "READY" in systemd.kinds(), what="READY=1")
        ready = next(f for _, f in systemd.read() if "READY" in f)
        assert "1/1 workers ready" in ready["STATUS"]
        wait_until(lambda: "WATCHDOG" in systemd.kinds() and "STATUS" in systemd.kinds(), what="WATCHDOG and STATUS")
        assert any("pending" in f.get("STATUS", "") and "lag" in f.get("STATUS", "") for _, f in systemd.read())

        # Every worker dead (restart backoff 3 s): the watchdog must go quiet.
        worker = sup.workers()[0]
        worker.send_signal(signal.SIGKILL)
        wait_until(lambda: "died" in sup.log(), what="the death noticed")
        quiet_from = time.monotonic()
        wait_until(lambda: "restarting worker 0" in sup.log(), what="restart planned")
        sup.wait_ready(1, timeout=30)
        back = time.monotonic()
        silent = [t for t, f in systemd.read() if "WATCHDOG" in f and quiet_from + 0.1 < t < back - 3.0]
        assert silent == [], "no WATCHDOG while no worker is ready"
        wait_until(lambda: any("WATCHDOG" in f and t > back for t, f in systemd.read()), what="WATCHDOG again")

        sup.signal(signal.SIGHUP)
        wait_until(lambda: "RELOADING" in systemd.kinds(), what="RELOADING=1")
        reloading = next(f for _, f in systemd.read() if "RELOADING" in f)
        assert int(reloading["MONOTONIC_USEC"]) > 0
        wait_until(lambda: systemd.kinds().count("READY") >= 2, what="READY=1 after the reload")

        assert sup.stop() == 0
        kinds = systemd.kinds()
        assert "STOPPING" in kinds
        order = [k for k in kinds if k in ("READY", "RELOADING", "STOPPING")]
        assert order[0] == "READY" and order[-1] == "STOPPING"
        assert order.index("RELOADING") < len(order) - 1 - order[::-1].index("READY")
    finally:
        systemd.close()


def rewrite_config(sup, **sections):
    for name, values in sections.items():
        sup.config.setdefault(name, {}).update(values)
    sup.config_path.write_text(tomli_w.dumps(sup.config))


def test_sighup_scales_up_without_losing_or_redelivering(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 2})
    sup.wait_ready(2)
    publish(nats_server.url, count=60, data="0.1")
    wait_until(lambda: len(sup.jobs.done()) >= 5, what="jobs flowing")
    rewrite_config(sup, workers={"count": 4})
    sup.signal(signal.SIGHUP)
    sup.wait_ready(4)
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked")
    done = sup.jobs.done()
    assert sorted(r.seq for r in done) == list(range(1, 61)) and all(r.delivery == 1 for r in done)
    assert nats_server.consumer()["num_redelivered"] == 0
    assert "reload: workers.count: 2 -> 4" in sup.log()
    assert sup.stop() == 0


def test_sighup_with_broken_config_keeps_running(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 2})
    sup.wait_ready(2)
    pids = sup.worker_pids()
    sup.config_path.write_text("[workers]\ncount = \"many\"\n")
    sup.signal(signal.SIGHUP)
    sup.wait_log(r"reload failed; still running on the previous config: workers.count: expected an integer")
    sup.config_path.write_text("[workers\n")
    sup.signal(signal.SIGHUP)
    sup.wait_log(r"reload failed.*not valid TOML")
    assert sup.proc.poll() is None and sup.worker_pids() == pids
    publish(nats_server.url, count=3, data="0")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="still processing jobs")
    assert sup.stop() == 0


def test_sighup_replaces_workers_one_at_a_time(nats_server, supervisor_factory):
    """A change workers read at fork time (concurrency) rolls the fleet, replacement first."""
    sup = supervisor_factory(nats_server, workers={"count": 2, "concurrency": 1})
    sup.wait_ready(2)
    old = sup.worker_pids()
    publish(nats_server.url, count=40, data="0.1")
    wait_until(lambda: len(sup.jobs.done()) >= 3, what="jobs flowing")
    rewrite_config(sup, workers={"concurrency": 2})
    sup.signal(signal.SIGHUP)
    wait_until(lambda: sup.worker_pids().isdisjoint(old) and len(sup.worker_pids()) == 2, what="both workers replaced")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked")
    assert sorted(r.seq for r in sup.jobs.done()) == list(range(1, 41))
    assert sup.log().count("recycling worker") == 2 and "config reloaded" in sup.log()
    assert sup.status()["crosscheck"]["crashes"] == 0
    assert sup.stop() == 0


def test_sigttin_sigttou_add_and_remove_a_worker(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 2})
    sup.wait_ready(2)
    sup.signal(signal.SIGTTIN)
    sup.wait_ready(3)
    sup.signal(signal.SIGTTOU)
    sup.wait_ready(2)              # signals of one kind coalesce while pending: one at a time
    sup.signal(signal.SIGTTOU)
    sup.wait_ready(1)
    assert sup.status()["workers"]["target"] == 1
    wait_until(lambda: len(sup.worker_pids()) == 1, what="retired workers gone")
    assert sup.stop() == 0


def test_sigquit_stops_at_once_and_naks_what_was_held(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 2, "graceful_timeout": 60.0},
                             consumer={"ack_wait": 300.0})
    sup.wait_ready(2)
    publish(nats_server.url, count=2, data="30")
    wait_until(lambda: len(sup.jobs.running()) == 2, what="two long jobs running")
    family = psutil.Process(sup.proc.pid).children()
    started = time.monotonic()
    sup.signal(signal.SIGQUIT)
    assert sup.wait(15) == 0
    assert time.monotonic() - started < 10, "SIGQUIT must not wait for the jobs"
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    # NAKed, not left to the 300 s AckWait: the next supervisor gets them at once.
    again = supervisor_factory(nats_server, workers={"count": 2}, consumer={"ack_wait": 300.0})
    redone = wait_until(lambda: len(again.jobs.started()) == 2 and again.jobs.started(), timeout=60,
                        what="both jobs redelivered long before AckWait")
    assert sorted((r.seq, r.delivery) for r in redone) == [(1, 2), (2, 2)]
