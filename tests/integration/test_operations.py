"""Operations (issue 5): sd_notify, Ctrl-C, reload and scaling by signal, SIGQUIT. Real processes, a
real nats-server, and a fake NOTIFY_SOCKET the test reads. What the supervisor did is read from
/status, /history, the server, and its structured log events (`--log-format json`), not from
its wording."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import nats
import psutil
import tomli_w
from harness import NatsServer, alive, publish, wait_until
from natsauth import free_port, nats_server_binary

JSON_LOGS = ("--log-format", "json")
ACK_WAIT = 60.0      # a job back within seconds was NAKed, not expired


class FakeSystemd:
    """A unix datagram socket standing in for systemd's notify socket. A thread reads it and
    stamps each datagram as it arrives (not when the test gets round to looking)."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict]] = []
        self.lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while self.running:
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.splitlines() if "=" in line)
            with self.lock:
                self.messages.append((time.monotonic(), fields))

    def read(self) -> list[tuple[float, dict]]:
        with self.lock:
            return list(self.messages)

    def drain_now(self) -> list[tuple[float, dict]]:
        """Everything sent so far, the datagrams still queued in the socket included."""
        self.sock.setblocking(False)
        try:
            while True:
                try:
                    data = self.sock.recv(4096).decode()
                except (BlockingIOError, OSError):
                    break
                fields = dict(line.split("=", 1) for line in data.splitlines() if "=" in line)
                with self.lock:
                    self.messages.append((time.monotonic(), fields))
        finally:
            self.sock.settimeout(0.1)
        return self.read()

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
        self.running = False
        self.thread.join(5)
        self.sock.close()


def test_sd_notify_sequence(nats_server, supervisor_factory, tmp_path):
    systemd = FakeSystemd(tmp_path / "notify.sock")
    sup = supervisor_factory(nats_server, workers={"count": 1}, env={"NOTIFY_SOCKET": systemd.path})
    try:
        wait_until(lambda: "READY" in systemd.kinds(), what="READY=1")
        ready = next(f for _, f in systemd.read() if "READY" in f)
        assert "1/1 workers ready" in ready["STATUS"]
        wait_until(lambda: "STATUS" in systemd.kinds(), what="STATUS")
        wait_until(lambda: any("pending" in f.get("STATUS", "") and "lag" in f.get("STATUS", "")
                               for _, f in systemd.read()), what="a STATUS line with pending and lag")

        sup.signal(signal.SIGHUP)
        wait_until(lambda: "RELOADING" in systemd.kinds(), what="RELOADING=1")
        reloading = next(f for _, f in systemd.read() if "RELOADING" in f)
        assert int(reloading["MONOTONIC_USEC"]) > 0
        wait_until(lambda: systemd.kinds().count("READY") >= 2, what="READY=1 after the reload")

        assert sup.stop() == 0
        kinds = systemd.drain_now() and systemd.kinds()
        assert "STOPPING" in kinds
        order = [k for k in kinds if k in ("READY", "RELOADING", "STOPPING")]
        assert order[0] == "READY" and order[-1] == "STOPPING"
        assert order.index("RELOADING") < len(order) - 1 - order[::-1].index("READY")
        assert "WATCHDOG" not in kinds, "no WATCHDOG_USEC, no watchdog"
    finally:
        systemd.close()


def test_watchdog_only_while_a_worker_is_ready(nats_server, supervisor_factory, tmp_path):
    """One worker, restart backoff 6 s: once it is SIGKILLed no worker is ready for about 6 s.
    The parent pings the watchdog every loop tick (at most 0.5 s) while one is; in that span it
    must send none, then ping again once the replacement is ready."""
    backoff = 6.0
    systemd = FakeSystemd(tmp_path / "notify.sock")
    sup = supervisor_factory(nats_server, workers={"count": 1}, args=JSON_LOGS,
                             restart={"backoff_initial": backoff, "backoff_max": backoff},
                             env={"NOTIFY_SOCKET": systemd.path, "WATCHDOG_USEC": "2000000"})
    try:
        sup.wait_ready(1)
        wait_until(lambda: systemd.kinds().count("WATCHDOG") >= 3, what="WATCHDOG while the worker is ready")
        [worker] = sup.workers()
        t_kill = time.monotonic()
        worker.send_signal(signal.SIGKILL)
        sup.wait_event("worker_died", worker_pid=worker.pid)
        t_seen = time.monotonic()
        planned = sup.wait_event("worker_restart_planned", worker_pid=worker.pid)
        assert planned["delay"] == backoff
        # No worker can be ready before t_kill + backoff; a datagram sent just before the reap may
        # be stamped up to a second late by the reader thread on a loaded box.
        quiet_from, quiet_to = t_seen + 1.0, t_kill + backoff - 0.5
        assert quiet_to - quiet_from >= 3.0, "the quiet span must be wide enough to mean something"
        wait_until(lambda: time.monotonic() > quiet_to, timeout=backoff + 5, what="the quiet span to pass")
        sent = [t for t, f in systemd.read() if "WATCHDOG" in f and quiet_from < t < quiet_to]
        assert sent == [], f"{len(sent)} WATCHDOG while no worker was ready"
        sup.wait_ready(1, timeout=30)
        back = time.monotonic()
        wait_until(lambda: any("WATCHDOG" in f and t > back for t, f in systemd.read()), what="WATCHDOG again")
        assert sup.stop() == 0
    finally:
        systemd.close()


def test_ready_only_once_every_worker_is_ready(nats_server, supervisor_factory, tmp_path):
    """Three workers, one held in its init hook until the test opens a gate: two are ready, the
    supervisor is still `starting` and has sent no READY=1; the third gets ready, READY=1 follows."""
    gate = tmp_path / "gate"
    gate.mkdir()
    systemd = FakeSystemd(tmp_path / "notify.sock")
    sup = supervisor_factory(nats_server, workers={"count": 3, "init": "testhandlers:gate_init"},
                             env={"NOTIFY_SOCKET": systemd.path, "GATE_DIR": str(gate), "GATE_ONE": "1"})
    try:
        def two_ready():
            s = sup.try_status()
            return s if s and sum(w["state"] == "ready" for w in s["workers"]["list"]) == 2 else None
        status = wait_until(two_ready, what="two of three workers ready")
        assert status["state"] == "starting"
        # The ready events /status reflects were handled by the loop that would have sent READY=1:
        # had it been sent, the datagram would be in the socket already.
        assert "READY" not in [k for _, f in systemd.drain_now() for k in f], systemd.read()
        assert sup.get("/healthz")[0] == 200, "two ready workers serve: healthy, just not all up"
        (gate / "open").touch()
        wait_until(lambda: "READY" in systemd.kinds(), what="READY=1 once the third is ready")
        ready = next(f for _, f in systemd.read() if "READY" in f)
        assert "3/3 workers ready" in ready["STATUS"]
        assert sup.status()["state"] == "running"
        assert sup.stop() == 0
    finally:
        systemd.close()


def rewrite_config(sup, **sections):
    for name, values in sections.items():
        sup.config.setdefault(name, {}).update(values)
    sup.config_path.write_text(tomli_w.dumps(sup.config))


# ---------------------------------------------------------------- Ctrl-C

def ctrl_c(sup) -> None:
    """What a terminal's Ctrl-C does: SIGINT to the whole foreground process group."""
    os.killpg(sup.proc.pid, signal.SIGINT)


def ctrl_c_with_two_jobs_running(nats_server, supervisor_factory, seconds: float):
    """Two workers each running a job of `seconds`; Ctrl-C; the supervisor is draining."""
    sup = supervisor_factory(nats_server, workers={"count": 2, "graceful_timeout": 60.0},
                             consumer={"ack_wait": ACK_WAIT})
    sup.wait_ready(2)
    publish(nats_server.url, count=2, data=str(seconds))
    wait_until(lambda: len(sup.jobs.running()) == 2, what="two jobs running")
    ctrl_c(sup)
    wait_until(lambda: (s := sup.try_status()) and s["state"] == "draining", what="draining")
    return sup


def test_ctrl_c_drains(nats_server, supervisor_factory):
    sup = ctrl_c_with_two_jobs_running(nats_server, supervisor_factory, 5)
    assert sup.wait() == 0
    assert sorted((r.seq, r.delivery) for r in sup.jobs.done()) == [(1, 1), (2, 1)], "both finished, once"
    assert nats_server.stream_msgs() == 0, "and acked"


def test_a_second_ctrl_c_stops_at_once(nats_server, supervisor_factory):
    sup = ctrl_c_with_two_jobs_running(nats_server, supervisor_factory, 30)
    started = time.monotonic()
    ctrl_c(sup)
    assert sup.wait(20) == 0, "the second Ctrl-C must not wait for the 30 s jobs"
    assert time.monotonic() - started < 15
    assert sup.jobs.done() == []
    # NAKed, not left to AckWait: the next supervisor gets both at once.
    again = supervisor_factory(nats_server, workers={"count": 2}, consumer={"ack_wait": ACK_WAIT})
    redone = wait_until(lambda: len(again.jobs.started()) == 2 and again.jobs.started(), timeout=ACK_WAIT / 3,
                        what="both jobs redelivered long before AckWait")
    assert sorted((r.seq, r.delivery) for r in redone) == [(1, 2), (2, 2)]


# ---------------------------------------------------------------- SIGHUP

def test_sighup_scales_up_without_losing_or_redelivering(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 2}, args=JSON_LOGS)
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
    assert [(e["key"], e["old"], e["new"]) for e in sup.events("reload_applied")] == [("workers.count", 2, 4)]
    assert sup.stop() == 0


def test_sighup_applies_consumer_restart_monitor_and_log_settings_live(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 1}, args=JSON_LOGS,
                             consumer={"ack_wait": 30.0, "max_ack_pending": 1000},
                             restart={"backoff_initial": 0.05, "backoff_max": 5.0},
                             monitor={"interval": 0.25, "lag_window": 60.0})
    sup.wait_ready(1)
    assert asyncio.run(consumer_config(nats_server.url)).ack_wait == 30.0
    rewrite_config(sup, consumer={"ack_wait": 45.0, "max_ack_pending": 500}, restart={"backoff_initial": 1.5},
                   monitor={"interval": 0.5, "lag_window": 20.0}, log={"level": "debug"})
    sup.signal(signal.SIGHUP)
    applied = {e["key"]: (e["old"], e["new"]) for e in wait_until(
        lambda: len(sup.events("reload_applied")) == 6 and sup.events("reload_applied"), what="the reload")}
    assert applied == {"consumer.ack_wait": (30.0, 45.0), "consumer.max_ack_pending": (1000, 500),
                       "restart.backoff_initial": (0.05, 1.5), "monitor.interval": (0.25, 0.5),
                       "monitor.lag_window": (60.0, 20.0), "log.level": ("info", "debug")}
    assert sup.events("reload_needs_restart") == []
    # consumer: on the server
    config = wait_until(lambda: (c := asyncio.run(consumer_config(nats_server.url))).ack_wait == 45.0 and c,
                        what="the consumer updated on the server")
    assert config.max_ack_pending == 500
    # monitor: what /history says it samples
    history = wait_until(lambda: (h := json.loads(sup.get("/history")[1]))["interval_s"] == 0.5 and h,
                         what="/history at the new interval")
    assert history["window_s"] == 20.0
    # restart: a worker that did useful work and dies waits the new backoff_initial
    publish(nats_server.url, count=1, data="0")
    wait_until(lambda: sup.status()["jobs"]["ack"] == 1, what="a job done")
    [worker] = sup.workers()
    worker.send_signal(signal.SIGKILL)
    assert sup.wait_event("worker_restart_planned", worker_pid=worker.pid)["delay"] == 1.5
    # log: the debug line of the restarted worker's start shows
    sup.wait_event("worker_started", slot=0)
    sup.wait_ready(1)
    assert sup.stop() == 0


def test_sighup_leaves_nats_embedded_and_stream_changes_for_a_restart(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 1}, args=JSON_LOGS)
    sup.wait_ready(1)
    rewrite_config(sup, nats={"name": "renamed"}, stream={"subjects": ["other.>"], "duplicate_window": 60.0},
                   embedded={"port": 14999})
    sup.signal(signal.SIGHUP)
    waiting = wait_until(lambda: len(sup.events("reload_needs_restart")) == 4 and sup.events("reload_needs_restart"),
                         what="four keys reported as waiting for a restart")
    assert sorted(e["key"] for e in waiting) == ["embedded.port", "nats.name", "stream.duplicate_window",
                                                 "stream.subjects"]
    assert sup.events("reload_applied") == []
    stream = asyncio.run(stream_config(nats_server.url))
    assert stream.subjects == ["jobs.>", "_sched.JOBS.>"] and stream.duplicate_window == 120.0, \
        "the stream left as it is (as created: the job subjects and the schedule space)"
    names = {c.get("name") for c in connz(nats_server)}
    assert "renamed" not in names and "jetstream-supervisor" in names, names
    publish(nats_server.url, count=3, data="0")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="still processing jobs")
    assert sup.stop() == 0


async def consumer_config(url: str):
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().consumer_info("JOBS", "workers")).config
    finally:
        await nc.close()


async def stream_config(url: str):
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info("JOBS")).config
    finally:
        await nc.close()


def connz(server) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/connz", timeout=5) as r:
        return json.load(r)["connections"]


def test_sighup_new_handler_name_takes_effect_on_new_workers(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 2}, args=JSON_LOGS)
    sup.wait_ready(2)
    old = sup.worker_pids()
    publish(nats_server.url, count=4, data="0")
    wait_until(lambda: len(sup.jobs.done()) == 4, what="jobs done by the first handler")
    rewrite_config(sup, workers={"handler": "testhandlers:record_v2"})
    sup.signal(signal.SIGHUP)
    wait_until(lambda: sup.worker_pids().isdisjoint(old) and len(sup.worker_pids()) == 2
               and sup.wait_ready(2), what="both workers replaced")
    publish(nats_server.url, count=4, data="0")
    wait_until(lambda: len(sup.jobs.done()) == 8, what="jobs done after the reload")
    after = sup.jobs.done()[4:]
    assert all(r.data.startswith("v2:") and r.pid not in old for r in after), after
    assert not [r for r in sup.jobs.done()[:4] if r.data.startswith("v2:")]
    assert sup.stop() == 0


def test_sighup_with_broken_config_keeps_running(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 2}, args=JSON_LOGS)
    sup.wait_ready(2)
    pids = sup.worker_pids()
    sup.config_path.write_text("[workers]\ncount = \"many\"\n")
    sup.signal(signal.SIGHUP)
    failed = sup.wait_event("reload_failed")
    assert "workers.count" in failed["reason"]               # names the key
    sup.config_path.write_text("[workers\n")
    sup.signal(signal.SIGHUP)
    wait_until(lambda: len(sup.events("reload_failed")) == 2, what="the second reload refused")
    assert sup.proc.poll() is None and sup.worker_pids() == pids
    assert sup.status()["workers"]["target"] == 2
    publish(nats_server.url, count=3, data="0")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="still processing jobs")
    assert sup.stop() == 0


def test_sighup_replaces_workers_one_at_a_time_replacement_first(nats_server, supervisor_factory):
    """A change workers read at fork time (here workers.init: new workers take 2 s to boot) rolls
    the fleet one worker at a time; each old worker leaves only once its replacement is ready,
    so two workers serve throughout."""
    sup = supervisor_factory(nats_server, workers={"count": 2, "concurrency": 1}, args=JSON_LOGS,
                             env={"SLOW_INIT": "2"})
    sup.wait_ready(2)
    old = sup.worker_pids()
    publish(nats_server.url, count=60, data="0.1")
    wait_until(lambda: len(sup.jobs.done()) >= 3, what="jobs flowing")
    rewrite_config(sup, workers={"init": "testhandlers:slow_init"})
    sup.signal(signal.SIGHUP)
    ready_counts = []                    # workers ready (serving) at each look during the roll
    deadline = time.monotonic() + 60
    while not (sup.worker_pids().isdisjoint(old) and len(sup.events("worker_exited")) == 2):
        ready_counts.append(sum(w["state"] == "ready" for w in sup.status()["workers"]["list"]))
        assert time.monotonic() < deadline, "the roll did not finish within 60 s"
        time.sleep(0.02)
    from test_crash_safety import recycle_order_ok
    assert recycle_order_ok(sup) == 2
    assert {e["worker_pid"] for e in sup.events("worker_recycling")} == old
    assert all("config reloaded" in e["reason"] for e in sup.events("worker_recycling"))
    assert min(ready_counts) == 2, ready_counts
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked")
    assert sorted(r.seq for r in sup.jobs.done()) == list(range(1, 61))
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
    assert not [p for p in family if alive(p)]
    # NAKed, not left to the 300 s AckWait: the next supervisor gets them at once.
    again = supervisor_factory(nats_server, workers={"count": 2}, consumer={"ack_wait": 300.0})
    redone = wait_until(lambda: len(again.jobs.started()) == 2 and again.jobs.started(), timeout=60,
                        what="both jobs redelivered long before AckWait")
    assert sorted((r.seq, r.delivery) for r in redone) == [(1, 2), (2, 2)]


def test_a_jetstream_that_does_not_answer_at_start_is_waited_for_within_startup_timeout(tmp_path, supervisor_factory):
    """`start` connects, but JetStream does not answer (a nats-server without it, then the real
    one on the same port; a link that drops just after the connect, or a stream leader being
    elected, look the same to it): the stream and consumer are ensured again within
    nats.startup_timeout, not given up at once with exit 4. Found by the randomized suite (seed
    700: a parent's link cut a second after its successor connected, the successor exited 4)."""
    port = free_port()
    bare = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = NatsServer(tmp_path / "store", port=port)
    try:
        wait_until(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, what="the bare server listening")
        sup = supervisor_factory(server, nats={"startup_timeout": 60.0})
        wait_until(lambda: "retrying for up to" in sup.log() or sup.proc.poll() is not None,
                   what="the stream's ensure retried")
        assert sup.proc.poll() is None, sup.log()[-2000:]
        bare.terminate()
        bare.wait(timeout=10)
        server.start()
        sup.wait_ready(2)
        publish(server.url, count=3, data="0")
        wait_until(lambda: len(sup.jobs.done()) == 3, what="jobs run once JetStream answers")
        assert sup.stop() == 0
    finally:
        bare.kill()
        server.stop()
