"""`supervisor demo`: a worker crash end to end, on a supervisor of its own.

    demo -> `supervisor start` (child process, own session, JSON logs on a pipe)
         -> wait for N ready workers (/status) -> publish the jobs, one of them `crash-once`
         -> ticker every TICK s from /status, events as the child logs them
         -> all acked (or a reason) -> SIGTERM the child, wait -> report -> exit 0 | 1

Without --config/--server the child gets a temp config (./config.toml and $SUPERVISOR_* are
ignored, so `supervisor demo` in a checkout never touches port 4222 or 9520): an embedded
nats-server in a temp dir on free ports, AckWait 30 s, so a job back within milliseconds is
visibly the supervisor's NAK, not the server's timer. With --config/--server it uses that
config, overriding only the worker count, the handler and the HTTP address.

Events come from the child's log (the supervisor says what happened, with a timestamp); the
numbers come from its /status. Exit 0 only if every published job was acked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import tomli_w
import uvloop

from supervisor import config as config_mod
from supervisor.cli.client import SupervisorUnreachable, http_call
from supervisor.cli.oneshot import default_subject
from supervisor.cli.render import paint, use_color
from supervisor.errors import EXIT_BUG, EXIT_OK, ConfigError
from supervisor.nats.consumer import lag_line
from workers.protocol.fork import scrub_child_env

HANDLER = "workers.examples:crash_on_marker"
JOB_SECONDS = 0.2            # what sleep_job does with a payload that is not a number
ACK_WAIT = 30.0              # long on purpose: a fast redelivery can only be the supervisor's NAK
TICK = 0.5                   # ticker period
POLL = 0.1                   # /status period (the child polls ConsumerInfo every MONITOR_INTERVAL)
MONITOR_INTERVAL = 0.1
READY_GRACE = 30.0           # beyond nats.startup_timeout for the workers to be ready
MAX_WARNINGS = 5             # other warnings from the child shown as events; the rest are counted
LOG_TAIL = 12                # child log lines shown when it fails


def cmd_demo(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError("--workers", f"must be 1 or more, got {args.workers}")
    if args.jobs < 1:
        raise ConfigError("--jobs", f"must be 1 or more, got {args.jobs}")
    if args.dashboard is not None and not args.dashboard >= 0:
        raise ConfigError("--dashboard", f"must be 0 seconds or more, got {args.dashboard:g}")
    return Demo(args, Out(sys.stdout)).run()


# ---------------------------------------------------------------- output

class Out:
    def __init__(self, stream: Any):
        self.stream = stream
        self.color = use_color(stream)
        self.t0: float | None = None          # wall clock when the jobs were published

    def say(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)

    def at(self, wall: float, text: str) -> None:
        """A line stamped with seconds since the jobs were published."""
        stamp = f"{wall - self.t0:5.1f}s" if self.t0 is not None else " " * 6     # before the jobs: no time
        self.say(f"{stamp}  {text}")

    def paint(self, text: str, color: str) -> str:
        return paint(text, color, self.color)


# ---------------------------------------------------------------- the child's log

# The supervisor's structured log events this demo narrates (extra={"event": ...} on its JSON
# lines: deaths.py worker_died, arbiter.py redelivered, pool.py worker_ready, embedded.py
# embedded_server). Their fields, not the wording, are the interface.
EVENTS = {"worker_died": "died", "redelivered": "redelivered", "worker_ready": "ready", "embedded_server": "embedded",
          "http_listening": "listening"}


@dataclass
class Event:
    kind: str                  # died | redelivered | ready | embedded | warning
    t: float                   # wall clock of the log record
    fields: dict[str, Any] = field(default_factory=dict)


def parse_log_line(line: str) -> tuple[str, Event | None]:
    """One JSON log line of the child -> (readable text, event or None)."""
    try:
        record = json.loads(line)
        message, level, t = str(record["message"]), str(record.get("level", "info")), float(record["ts"])
    except (ValueError, KeyError, TypeError):
        return line, None                     # not ours (a stray print): keep it for the tail
    kind = EVENTS.get(record.get("event", ""))
    if kind:
        return message, Event(kind, t, record)
    if level in ("warning", "error", "critical"):
        return message, Event("warning", t, {"level": level, "message": message})
    return message, None


class ChildLog:
    """Reads the child's stdout+stderr on a thread: events to a queue, the last lines kept."""

    def __init__(self, stream: Any):
        self.events: queue.Queue[Event] = queue.Queue()
        self.tail: deque[str] = deque(maxlen=LOG_TAIL)
        self.thread = threading.Thread(target=self._read, args=(stream,), name="demo-child-log", daemon=True)
        self.thread.start()

    def _read(self, stream: Any) -> None:
        for raw in stream:
            text, event = parse_log_line(raw.decode(errors="replace").rstrip())
            if text:
                self.tail.append(text)
            if event:
                self.events.put(event)

    def next(self, timeout: float) -> Event | None:
        try:
            return self.events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None


# ---------------------------------------------------------------- the demo

class DemoFailed(Exception):
    """The scenario did not complete; the message is the reason printed with FAIL."""


class Demo:
    """One run of the seed's experiment: start a supervisor, publish, narrate its events, check the
    result, stop it, report. Long because it is one story told in order (run() reads top to
    bottom), and each step keeps what the report needs; a split would only pass that around."""

    def __init__(self, args: argparse.Namespace, out: Out):
        self.args, self.out = args, out
        self.n, self.jobs = args.workers, args.jobs
        self.crash_index = max(1, args.jobs // 5)          # 30 jobs: job-06
        self.configured = bool(args.config or args.server)
        self.tmp = Path(tempfile.mkdtemp(prefix="supervisor-demo-"))
        # Port 0: the child binds a free port itself and logs which (http_listening); a port
        # picked here could be taken by anyone before the child binds it (seen at -n 6: exit 2).
        self.http = "127.0.0.1:0"
        self.base = ""
        try:
            self.cfg = self.load_config()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.child: subprocess.Popen | None = None
        self.log: ChildLog | None = None
        self.server_pid: int | None = None
        self.seqs: list[int] = []
        self.labels: dict[int, str] = {}
        self.deaths: dict[int, float] = {}                 # seq -> wall time of the death that held it
        self.crashed_slots: set[int] = set()
        self.latencies: list[tuple[int, float]] = []        # (seq, seconds from death to redelivery)
        self.warnings = 0
        self.shown: set[str] = set()                        # warnings already printed as events
        self.base_status: dict[str, Any] = {}
        self.last: dict[str, Any] = {}
        self.t_done: float | None = None
        self.stop_note = ""
        self.remaining: int | None = None                   # messages left in the stream at the end
        self.published_at = float("inf")                    # wall clock once every PubAck is in

    # -- configuration

    def load_config(self) -> config_mod.Config:
        if self.configured:
            return config_mod.from_args(self.args)
        path = self.tmp / "config.toml"
        path.write_text(tomli_w.dumps({
            "nats": {"servers": []},
            "embedded": {"port": 0, "monitor_port": -1, "store_dir": str(self.tmp / "store")},
            "consumer": {"ack_wait": ACK_WAIT},
            "workers": {"count": self.n, "handler": HANDLER},
            "monitor": {"http": self.http, "interval": MONITOR_INTERVAL},
        }))
        return config_mod.load(path, {}, {})

    def child_command(self) -> list[str]:
        cmd = [sys.executable, "-m", "supervisor", "start"]
        if self.configured:
            cmd += ["--config", self.args.config] if self.args.config else []
            cmd += [arg for server in self.args.server or [] for arg in ("--server", server)]
        else:
            cmd += ["--config", str(self.tmp / "config.toml")]
        return cmd + ["--workers", str(self.n), "--handler", HANDLER, "--http", self.http, "--log-format", "json"]

    def child_env(self) -> dict[str, str]:
        env = dict(scrub_child_env(dict(os.environ)))
        if not self.configured:                            # the temp config is the whole config
            env = {k: v for k, v in env.items() if not k.startswith("SUPERVISOR_")}
        else:
            env.setdefault("SUPERVISOR_MONITOR_INTERVAL", str(MONITOR_INTERVAL))
        env["SUPERVISOR_LOG_LEVEL"] = "info"              # the events are info lines
        return env

    # -- the run

    def run(self) -> int:
        previous = signal.signal(signal.SIGTERM, _interrupt)
        failure: str | None = None
        try:
            self.start()
            self.wait_ready()
            self.publish()
            self.watch()
            failure = self.verify()
            if failure is None and self.args.dashboard is not None:
                self.keep_serving(self.args.dashboard)
        except DemoFailed as exc:
            failure = str(exc)
        except KeyboardInterrupt:
            failure = "interrupted"
            self.out.say()
        finally:                         # whatever happened, even a bug: no process left behind
            stopped = self.stop()
            signal.signal(signal.SIGTERM, previous)
            shutil.rmtree(self.tmp, ignore_errors=True)
        return self.report(failure or stopped)

    def start(self) -> None:
        from workers.protocol.fork import set_parent_death_signal

        o = self.out
        share = "share one durable consumer" if self.n > 1 else "on one durable consumer"
        o.say(o.paint(f"supervisor demo: {_plural(self.n, 'worker')} {share}; "
                      f"{_plural(self.jobs, 'job')} of {JOB_SECONDS:g} s; "
                      f"{self.label_of(self.crash_index)} crashes its worker", "bold"))
        self.child = subprocess.Popen(
            self.child_command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=self.child_env(), start_new_session=True,          # Ctrl-C is ours; we stop the child
            preexec_fn=lambda: set_parent_death_signal(signal.SIGTERM))  # ... even if we are killed
        self.log = ChildLog(self.child.stdout)

    def wait_ready(self) -> None:
        started = time.monotonic()
        deadline = started + self.cfg.nats.startup_timeout + READY_GRACE
        while True:
            self.check_child()
            self.drain_events(0.0)
            s = self.status() or {}
            workers = s.get("workers", {})
            if workers.get("ready", 0) >= self.n and workers.get("alive") == self.n \
                    and s["consumer"].get("poll_age_s") is not None:
                break
            if time.monotonic() > deadline:
                raise DemoFailed(f"{workers.get('ready', 0)}/{self.n} workers ready after "
                                 f"{time.monotonic() - started:.0f}s")
            self.drain_events(0.05)
        self.base_status = s
        pids = ", ".join(f"w{w['slot']} pid {w['pid']}" for w in workers["list"])
        nats = s.get("nats", {})
        if not nats.get("embedded"):
            self.out.say(f"  nats-server {nats.get('server')} (configured)")
        self.out.say(f"  supervisor pid {s['pid']}, {_plural(self.n, 'worker')} ready in "
                     f"{time.monotonic() - started:.2f} s: {pids}")
        self.out.say(f"  status: supervisor status --url {self.http}    "
                     f"(AckWait {self.cfg.consumer.ack_wait:g} s)")
        if self.args.dashboard is not None:
            self.out.say(f"  dashboard: {self.base}/")

    def publish(self) -> None:
        payloads = ["crash-once" if i == self.crash_index else f"job-{i:02d}" for i in range(1, self.jobs + 1)]
        cfg = self.nats_config()
        subject = default_subject(cfg)
        self.out.t0 = time.time()
        self.seqs = uvloop.run(_publish(cfg, subject, payloads))
        self.published_at = time.time()
        self.labels = {seq: self.label_of(i) for i, seq in enumerate(self.seqs, 1)}
        self.out.say(f"  published {len(self.seqs)} jobs to {subject} (stream {self.base_status['consumer']['stream']}"
                     f" seq {self.seqs[0]}-{self.seqs[-1]}) in {1000 * (time.time() - self.out.t0):.0f} ms")

    def label_of(self, i: int) -> str:
        width = max(2, len(str(self.jobs)))
        return f"job-{i:0{width}d}"

    def nats_config(self) -> config_mod.Config:
        """Where to publish: the child's embedded server (its real port), else the configured servers."""
        nats = self.base_status.get("nats", {})
        if nats.get("embedded") and nats.get("server"):
            return config_mod.with_servers(self.cfg, (f"nats://{nats['server']}",))
        return self.cfg

    def watch(self) -> None:
        deadline = time.monotonic() + 30.0 + self.cfg.consumer.ack_wait + 3 * self.jobs * JOB_SECONDS / self.n
        next_tick = next_poll = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_poll:
                self.check_child()
                self.last = self.status() or self.last
                next_poll = now + POLL
                if self.all_acked(self.last):
                    self.t_done = time.time()
                    self.tick()
                    return
            if now >= next_tick:
                self.tick()
                next_tick += TICK
            if now > deadline:
                raise DemoFailed(f"not every job acked after {time.time() - (self.out.t0 or time.time()):.0f}s")
            self.drain_events(min(next_poll, next_tick) - time.monotonic())

    def keep_serving(self, seconds: float) -> None:
        """--dashboard: the jobs are done; leave the supervisor up so its dashboard can be read.
        Ctrl-C (or SIGTERM) ends the wait early and the demo stops and reports as usual."""
        until = "until Ctrl-C" if math.isinf(seconds) else f"for {seconds:g} s (Ctrl-C ends it sooner)"
        self.out.say(f"  dashboard stays up at {self.base}/ {until}")
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                self.check_child()
                self.drain_events(min(0.5, deadline - time.monotonic()))
        except KeyboardInterrupt:
            self.out.say()

    def all_acked(self, s: dict[str, Any]) -> bool:
        c = s.get("consumer", {})
        return bool(self.seqs) and c.get("num_pending") == 0 and c.get("num_ack_pending") == 0 \
            and c.get("ack_floor_stream_seq", 0) >= self.seqs[-1]

    def tick(self) -> None:
        s = self.last
        c = s.get("consumer", {}) if s else {}
        if c.get("num_pending") is None or time.time() - (c.get("poll_age_s") or 0.0) < self.published_at:
            return                       # no ConsumerInfo since the jobs were published: nothing new to say
        acked = s.get("jobs", {}).get("ack", 0) - self.base_status.get("jobs", {}).get("ack", 0)
        w = s["workers"]
        self.out.at(time.time(), f"{lag_line(s['consumer'])}  workers {w['alive']}/{w['target']}  "
                                 f"acked {min(acked, self.jobs)}/{self.jobs}")

    def verify(self) -> str | None:
        """After the consumer reads all acked: the work-queue stream must be empty too."""
        if self.configured:
            return None                  # a shared stream may hold other publishers' messages
        self.remaining = uvloop.run(_stream_messages(self.nats_config(), self.last["consumer"]["stream"]))
        return f"{self.remaining} message(s) still in the stream" if self.remaining else None

    # -- events

    def drain_events(self, timeout: float) -> None:
        """Print the child's events as they come, waiting up to `timeout` for the first."""
        if self.log is None:
            return
        event = self.log.next(timeout)
        while event is not None:
            self.show(event)
            event = self.log.next(0.0)

    def show(self, e: Event) -> None:
        f, o = e.fields, self.out
        if e.kind == "listening":
            self.base = str(f["url"])
            self.http = self.base.removeprefix("http://")
        elif e.kind == "embedded":
            self.server_pid = int(f["server_pid"])
            monitor = f", monitoring {f['monitor']}/jsz" if f.get("monitor") else ""
            o.say(f"  nats-server pid {f['server_pid']} (embedded) on {f['url']}{monitor}")
        elif e.kind == "died":
            self.show_death(e)
        elif e.kind == "redelivered":
            self.show_redelivery(e)
        elif e.kind == "ready" and int(f["slot"]) in self.crashed_slots:
            self.crashed_slots.discard(int(f["slot"]))
            o.at(e.t, f"w{f['slot']} restarted: pid {f['worker_pid']} ready in {f['ms']} ms")
        elif e.kind == "warning":
            self.warnings += 1
            if self.warnings <= MAX_WARNINGS:
                self.shown.add(f["message"])
                o.at(e.t, o.paint(f"{f['level']}: {f['message']}", "yellow"))

    def show_death(self, e: Event) -> None:
        f, o = e.fields, self.out
        held, naked = f["held"], len(f["naked"])
        for seq in held:
            self.deaths[seq] = e.t
        self.crashed_slots.add(int(f["slot"]))
        what = ", ".join(f"{self.labels.get(seq, 'job')} (seq {seq})" for seq in held) or "no job"
        said = f"; the supervisor NAKed {'it' if naked == 1 else naked} at once" if naked else ""
        o.at(e.t, o.paint(f"w{f['slot']} CRASHED ({f['cause']}) holding {what}, no ack", "red") + said)

    def show_redelivery(self, e: Event) -> None:
        f, o = e.fields, self.out
        seq = int(f["seq"])
        label = f"{self.labels.get(seq, 'job')} again (seq {seq}, delivery #{f['delivery']})"
        died = self.deaths.pop(seq, None)
        if died is None:
            o.at(e.t, o.paint(f"w{f['slot']} got {label}: {f['why'] or 'no explanation yet'}", "yellow"))
            return
        self.latencies.append((seq, e.t - died))
        o.at(e.t, o.paint(f"w{f['slot']} got {label} {1000 * (e.t - died):.0f} ms after the crash", "green")
             + f" (AckWait alone: {self.cfg.consumer.ack_wait:g} s)")

    # -- the child

    def status(self) -> dict[str, Any] | None:
        if not self.base:
            return None                  # its HTTP endpoint has not said where it listens yet
        try:
            code, body = http_call(self.base, "GET", "/status")
            return json.loads(body) if code == 200 else None
        except (SupervisorUnreachable, ValueError):
            return None

    def check_child(self) -> None:
        if self.child is not None and self.child.poll() is not None:
            raise DemoFailed(f"the supervisor exited with code {self.child.returncode}")

    def stop(self) -> str | None:
        """SIGTERM the child and wait for it (its workers drain); a second Ctrl-C kills it.
        Returns a failure reason when it did not stop cleanly."""
        child = self.child
        if child is None:
            return None
        exited_early = child.poll() is not None
        started = time.monotonic()
        try:
            if not exited_early:
                child.send_signal(signal.SIGTERM)
                child.wait(self.cfg.workers.graceful_timeout + 15.0)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            child.kill()
            child.wait()
        self.reap_leftovers(child.pid)
        if self.log:
            self.log.thread.join(5.0)
            self.drain_events(0.0)
        if exited_early:
            return None                  # check_child already named it
        if child.returncode != 0:
            return f"the supervisor did not stop cleanly (exit code {child.returncode})"
        self.stop_note = f"supervisor stopped cleanly in {time.monotonic() - started:.1f} s (SIGTERM, workers drained)"
        return None

    def reap_leftovers(self, pgid: int) -> None:
        """Nothing of ours may outlive the demo: the child's process group (its workers) and the
        embedded server (its own group) get a moment to follow their parent, then SIGKILL."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and (_group_alive(pgid) or _alive(self.server_pid)):
            time.sleep(0.02)
        if _group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
        if self.server_pid is not None and _alive(self.server_pid) and _is_nats_server(self.server_pid):
            os.kill(self.server_pid, signal.SIGKILL)

    # -- the report

    def report(self, failure: str | None) -> int:
        o, s = self.out, self.last
        if s:
            o.say(o.paint("report", "bold"))
            for line in self.report_lines(s):
                o.say(f"  {line}")
        if self.stop_note:
            o.say(f"  {self.stop_note}")
        if failure is None and not self.all_acked(s):
            failure = "not every job was acked"
        if failure is None:
            where = "stream empty" if self.remaining == 0 else "nothing pending"
            o.say(o.paint(f"PASS: every job acked ({len(self.seqs)}/{self.jobs}): {where}, nothing in flight",
                          "green"))
            return EXIT_OK
        o.say(o.paint(f"FAIL: {failure}", "red"))
        if self.log and self.child is not None and self.child.returncode not in (0, None) and failure != "interrupted":
            tail = [line for line in self.log.tail if line not in self.shown]
            if tail:
                o.say("  the supervisor's last words:")
            for line in tail[-3:]:
                o.say(f"    {line}")
        return EXIT_BUG

    def explain(self, deliveries: int, unique: int) -> list[str]:
        """What the ticker's numbers mean, for someone reading them for the first time."""
        again = deliveries - unique
        return ["redelivered= counts jobs in flight that had been delivered before (a crashed worker's job "
                "on its second try); it drops back to 0 once they are acked.",
                f"delivered= counts deliveries, not jobs: {deliveries} for {_plural(unique, 'job')}"
                + (f"; the extra {again} {'is' if again == 1 else 'are'} the redeliver{'y' if again == 1 else 'ies'} "
                   "after the crash." if again else ", one each.")]

    def report_lines(self, s: dict[str, Any]) -> list[str]:
        c, base = s["consumer"], self.base_status.get("consumer", {})
        deliveries = c.get("delivered_consumer_seq", 0) - base.get("delivered_consumer_seq", 0)
        unique = sum(1 for seq in self.seqs if seq <= c.get("delivered_stream_seq", 0))
        acked = s.get("jobs", {}).get("ack", 0) - self.base_status.get("jobs", {}).get("ack", 0)
        x = s.get("crosscheck", {})
        lines = [f"deliveries={deliveries} unique={unique} redelivered={deliveries - unique}  (workers acked {acked})",
                 f"final    {lag_line(c)}" + (f"; stream {c.get('stream')}: {self.remaining} message(s) left"
                                             if self.remaining is not None else ""),
                 f"cross-check: crashes={x.get('crashes', 0)} held at crash={x.get('jobs_held_at_crash', 0)} "
                 f"NAKed={x.get('held_jobs_naked', 0)} redelivered={x.get('held_jobs_redelivered', 0)} "
                 f"acked after crash={x.get('held_jobs_acked_after_crash', 0)} "
                 f"unexplained={x.get('unexplained_redeliveries', 0)} outstanding={len(x.get('outstanding', []))}",
                 *self.explain(deliveries, unique)]
        for seq, seconds in self.latencies:
            lines.append(f"{self.labels.get(seq, f'seq {seq}')} was back in {1000 * seconds:.0f} ms; without the "
                         f"supervisor's NAK the server would have waited AckWait ({self.cfg.consumer.ack_wait:g} s)")
        if self.t_done is not None and self.out.t0 is not None:
            elapsed = self.t_done - self.out.t0
            lines.append(f"elapsed {elapsed:.1f} s with {_plural(self.n, 'worker')}; one worker needs about "
                         f"{self.jobs * JOB_SECONDS:.1f} s ({self.jobs} x {JOB_SECONDS:g} s)")
        return lines


# ---------------------------------------------------------------- helpers

def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt          # SIGTERM: the same clean stop as Ctrl-C


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _alive(pid: int | None) -> bool:
    return pid is not None and psutil.pid_exists(pid)


def _is_nats_server(pid: int) -> bool:
    try:
        return "nats-server" in psutil.Process(pid).name()
    except psutil.Error:
        return False


async def _publish(cfg: config_mod.Config, subject: str, payloads: list[str]) -> list[int]:
    """Publish every payload as a burst and wait for the PubAcks; the stream sequences, in order."""
    import asyncio

    from supervisor.nats import provision

    nc = await provision.connect_until(cfg, name=f"{cfg.nats.name} demo")
    try:
        js = nc.jetstream()
        acks = await asyncio.gather(*(js.publish(subject, p.encode(), timeout=10) for p in payloads))
        return [ack.seq for ack in acks]
    finally:
        await nc.drain()


async def _stream_messages(cfg: config_mod.Config, stream: str) -> int:
    from supervisor.nats import provision

    nc = await provision.connect_until(cfg, name=f"{cfg.nats.name} demo")
    try:
        return (await nc.jetstream().stream_info(stream)).state.messages
    finally:
        await nc.drain()
