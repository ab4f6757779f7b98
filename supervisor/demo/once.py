"""`supervisor demo --scenario once`: the crash in the worst place, and nothing happens twice.

The seed demo's machinery (demo.py: a supervisor of its own on an embedded server, its events,
ticker and clean stop), with workers.examples:record_once as the handler, [idempotency] on and
double_ack on, and three moments the seed demo does not have:

  1. publish 30 jobs with Nats-Msg-Id, then publish them all again at once (a publisher retrying):
     the stream drops every copy, inside its duplicate window (DUPLICATE_WINDOW s here);
  2. one job's first delivery writes its row, commits, and exits the worker before the ack: the
     supervisor NAKs it, the redelivery runs the handler again, and once() finds the row's
     done-marker: no second row;
  3. after the window has passed, that job's Nats-Msg-Id is published once more: the stream keeps
     it this time, and the worker's KV guard finds the done-marker and acks it without running it.

PASS only if the sqlite file holds exactly one row per job and the late copy was acked as a duplicate.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from typing import Any

import uvloop

from supervisor import config as config_mod
from supervisor.cli.oneshot import default_subject
from supervisor.demo.crash import ChildLog, Demo, DemoFailed, Out, _plural
from supervisor.errors import ConfigError

HANDLER = "workers.examples:record_once"
CRASH = "crash-after-commit"
DUPLICATE_WINDOW = 2.0       # short, so that the late copy can be shown within seconds
MAX_WINDOW_WAIT = 15.0       # a configured stream with a longer window: the late copy is skipped


def cmd_demo(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError("--workers", f"must be 1 or more, got {args.workers}")
    if args.jobs < 1:
        raise ConfigError("--jobs", f"must be 1 or more, got {args.jobs}")
    return OnceDemo(args, Out(sys.stdout)).run()


class OnceDemo(Demo):
    def __init__(self, args: argparse.Namespace, out: Out):
        super().__init__(args, out)
        self.prefix = f"demo-{secrets.token_hex(3)}"       # fresh ids: a configured server may have seen ours
        self.db = self.tmp / "records.db"
        self.retry_dups = 0
        self.late: dict[str, Any] = {}
        self.records: list[tuple] = []

    # -- the child: same supervisor, another handler, the guard on

    def child_command(self) -> list[str]:
        cmd = super().child_command()
        cmd[cmd.index("--handler") + 1] = HANDLER
        return cmd

    def child_env(self) -> dict[str, str]:
        env = super().child_env()
        env.update(RECORD_ONCE_DB=str(self.db), SUPERVISOR_IDEMPOTENCY_ENABLED="true",
                   SUPERVISOR_WORKERS_DOUBLE_ACK="true", SUPERVISOR_STREAM_DUPLICATE_WINDOW=str(DUPLICATE_WINDOW))
        return env

    def start(self) -> None:
        from workers.protocol.fork import set_parent_death_signal

        o = self.out
        o.say(o.paint(f"supervisor demo --scenario once: {_plural(self.n, 'worker')}, {_plural(self.jobs, 'job')} "
                      f"with a Nats-Msg-Id, each recorded once in a sqlite file; {self.label_of(self.crash_index)} "
                      "crashes its worker after its row committed, before its ack", "bold"))
        self.child = subprocess.Popen(
            self.child_command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=self.child_env(), start_new_session=True, preexec_fn=lambda: set_parent_death_signal(signal.SIGTERM))
        self.log = ChildLog(self.child.stdout)

    # -- 1. publish, and publish again

    def publish(self) -> None:
        items = [(f"{self.prefix}-{i}", CRASH if i == self.crash_index else self.label_of(i))
                 for i in range(1, self.jobs + 1)]
        cfg = self.nats_config()
        subject = default_subject(cfg)
        self.out.t0 = time.time()
        acks = uvloop.run(_publish(cfg, subject, items))
        self.published_at = time.time()
        self.seqs = [a.seq for a in acks]
        self.labels = {seq: self.label_of(i) for i, seq in enumerate(self.seqs, 1)}
        self.out.say(f"  published {len(acks)} jobs to {subject} with Nats-Msg-Id {items[0][0]}..{items[-1][0]} "
                     f"(seq {self.seqs[0]}-{self.seqs[-1]})")
        again = uvloop.run(_publish(cfg, subject, items))
        self.retry_dups = sum(1 for a in again if a.duplicate)
        self.out.say(f"  a publisher retry sends the same {len(items)} ids again: {len(items) - self.retry_dups} "
                     f"stored, {self.retry_dups} dropped by the stream as duplicates (inside its duplicate window)")

    # -- 2. and 3. what the sqlite file says; the late copy

    def verify(self) -> str | None:
        failure = super().verify()
        if failure:
            return failure
        failure = self.check_records()
        if failure or self.retry_dups != self.jobs:
            return failure or f"the stream stored {self.jobs - self.retry_dups} re-published copies"
        return self.late_copy()

    def check_records(self) -> str | None:
        conn = sqlite3.connect(self.db)
        try:
            self.records = conn.execute("SELECT key, stream_seq, delivery, pid FROM records ORDER BY stream_seq").fetchall()
        finally:
            conn.close()
        keys = [r[0] for r in self.records]
        if len(keys) != self.jobs or len(set(keys)) != self.jobs:
            return (f"{len(keys)} rows for {len(set(keys))} distinct jobs in {self.db.name} "
                    f"(want {self.jobs} and {self.jobs})")
        return None

    def late_copy(self) -> str | None:
        """Re-publish the crashed job's id until the stream stores it (it drops it while the window
        lasts), then wait for the workers to ack it without running it."""
        crash_id = f"{self.prefix}-{self.crash_index}"
        base = (self.status() or {}).get("jobs", {}).get("duplicate", 0)
        result = uvloop.run(_publish_after_window(self.nats_config(), default_subject(self.cfg), crash_id,
                                                  self.label_of(self.crash_index)))
        if result is None:
            self.late = {"skipped": True}
            return None
        self.late = {"id": crash_id, "seq": result[0]}
        deadline = time.monotonic() + 30.0
        while True:
            self.check_child()
            s = self.status() or {}
            if s.get("jobs", {}).get("duplicate", 0) > base and s.get("consumer", {}).get("num_ack_pending") == 0:
                break
            if time.monotonic() > deadline:
                raise DemoFailed(f"the late copy of {crash_id} was not acked as a duplicate")
            self.drain_events(0.1)
        self.out.at(time.time(), f"{crash_id} published again, past the {result[1]:g} s window: stored as seq "
                                 f"{result[0]}; a worker found its done-marker and acked it without running it")
        return self.check_records()

    def report_lines(self, s: dict[str, Any]) -> list[str]:
        lines = super().report_lines(s)
        crashed = [r for r in self.records if r[1] == self.seqs[self.crash_index - 1]] if self.seqs else []
        if self.records:
            lines.append(f"{self.db.name}: {len(self.records)} rows for {self.jobs} jobs, each key once")
        if crashed:
            key, seq, delivery, pid = crashed[0]
            lines.append(f"{self.label_of(self.crash_index)}'s row was written by delivery #{delivery} (pid {pid}), "
                         "which died before its ack; the redelivery found the row's done-marker (once(): fresh=False) "
                         "and wrote nothing")
        if self.late.get("skipped"):
            lines.append(f"late copy skipped: the stream's duplicate window is longer than {MAX_WINDOW_WAIT:g} s")
        elif self.late:
            lines.append(f"late copy of {self.late['id']} (seq {self.late['seq']}): acked as a duplicate, not run "
                         "([idempotency] KV done-marker)")
        return lines


async def _publish(cfg: config_mod.Config, subject: str, items: list[tuple[str, str]]) -> list[Any]:
    from supervisor.nats import provision

    nc = await provision.connect_until(cfg, name=f"{cfg.nats.name} demo")
    try:
        js = nc.jetstream()
        return await asyncio.gather(*(js.publish(subject, data.encode(), headers={"Nats-Msg-Id": msg_id}, timeout=10)
                                      for msg_id, data in items))
    finally:
        await nc.drain()


async def _publish_after_window(cfg: config_mod.Config, subject: str, msg_id: str,
                                data: str) -> tuple[int, float] | None:
    """(stream seq, the stream's window) once the stream stores the copy; None when its window is
    too long to wait for."""
    from supervisor.nats import provision

    nc = await provision.connect_until(cfg, name=f"{cfg.nats.name} demo")
    try:
        js = nc.jetstream()
        window = (await js.stream_info(cfg.stream.name)).config.duplicate_window or 0.0
        if window > MAX_WINDOW_WAIT:
            return None
        started = time.monotonic()
        while True:       # a copy inside the window is dropped by the stream: trying again costs nothing
            ack = await js.publish(subject, data.encode(), headers={"Nats-Msg-Id": msg_id}, timeout=10)
            if not ack.duplicate:
                return ack.seq, window
            if time.monotonic() - started > window + 10.0:
                raise DemoFailed(f"the stream still drops {msg_id} {window + 10:.0f} s after publishing it")
            await asyncio.sleep(0.1)
    finally:
        await nc.drain()
