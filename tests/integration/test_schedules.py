"""Delayed and recurring jobs through NATS message schedules, on a real nats-server with real
supervisors: `publish --delay/--at` jobs start when due and not before; a schedule `every = 1`
shared by two supervisors fires once a second, not twice, and goes when the config drops it; a
stream made without schedules refuses them clearly; bad input exits 2 naming the key."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time

import nats
import pytest
import tomli_w
from harness import publish, run_cli, wait_until
from nats.js import api

JSON_LOGS = ("--log-format", "json")
TICK = {"tick": {"every": 1.0, "subject": "jobs.tick", "data": "tick"}}


def schedule_names(url: str, tmp) -> dict[str, str]:
    """name -> made_by, from `supervisor schedule list --json`."""
    r = run_cli("schedule", "list", "--json", "--server", url, tmp=tmp)
    assert r.returncode == 0, r.stderr
    return {s["name"]: s["made_by"] for s in json.loads(r.stdout)["schedules"]}


def done(sups, data: str) -> list:
    return [r for sup in sups for r in sup.jobs.done() if r.data == data]


def test_delayed_jobs_are_stored_now_and_start_when_due_not_before(nats_server, supervisor_factory, tmp_path):
    sup = supervisor_factory(nats_server, workers={"count": 2})
    sup.wait_ready()
    # Stored now, delivered then: a job due in an hour waits in the stream, and no worker has it.
    publish(nats_server.url, count=1, data="later", tmp=tmp_path, extra=("--delay", "3600"))
    r = run_cli("schedule", "list", "--json", "--server", nats_server.url, tmp=tmp_path)
    assert json.loads(r.stdout)["delayed_jobs"] == 1
    assert nats_server.consumer()["num_pending"] == 0 and nats_server.consumer()["num_ack_pending"] == 0

    before = time.time()             # the CLI reads the clock after this: each job is due >= before + 2
    out = publish(nats_server.url, count=3, data="d", tmp=tmp_path, extra=("--delay", "2", "--msg-id", "late"))
    assert "3 stored, 0 duplicates" in out
    again = publish(nats_server.url, count=3, data="d", tmp=tmp_path, extra=("--delay", "2", "--msg-id", "late"))
    assert "0 stored, 3 duplicates" in again, "--msg-id dedupes the delayed jobs too"
    due = dt.datetime.now(dt.UTC).replace(microsecond=0) + dt.timedelta(seconds=3)
    publish(nats_server.url, count=2, data="a", tmp=tmp_path, extra=("--at", due.isoformat().replace("+00:00", "Z")))

    wait_until(lambda: len(done([sup], "d")) == 3 and len(done([sup], "a")) == 2, what="the delayed jobs done")
    starts = {r.data: [s.t for s in sup.jobs.started() if s.data == r.data] for r in sup.jobs.done()}
    assert min(starts["d"]) >= before + 2.0, (before, starts["d"])
    assert min(starts["a"]) >= due.timestamp(), (due, starts["a"])
    assert len(sup.jobs.started()) == 5, "each delayed job ran once (the duplicates never became jobs)"
    assert json.loads(run_cli("schedule", "list", "--json", "--server", nats_server.url, tmp=tmp_path).stdout
                      )["delayed_jobs"] == 1, "a fired job's schedule is gone; the one due in an hour waits"
    assert sup.stop() == 0


def test_a_schedule_fires_once_per_period_for_two_supervisors_and_goes_with_the_config(
        nats_server, supervisor_factory, tmp_path):
    a = supervisor_factory(nats_server, workers={"count": 1}, args=JSON_LOGS, schedules=TICK)
    a.wait_ready()
    a.wait_event("schedule_added", schedule="tick")
    b = supervisor_factory(nats_server, workers={"count": 1}, args=JSON_LOGS, schedules=TICK)
    b.wait_ready()
    assert b.status()["schedules"]["kept"] == ["tick"] and not b.events("schedule_added"), \
        "the second supervisor found the first one's schedule and left it"
    r = run_cli("schedule", "add", "byhand", "--every", "3600", "--subject", "jobs.byhand", "--server",
                nats_server.url, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert schedule_names(nats_server.url, tmp_path) == {"tick": "config", "byhand": "cli"}

    # Firings counted by the server: each one stores one job, and nothing else is published now.
    # At most one per period in any span (the server fires on whole seconds): over E seconds at
    # most E/1 + 1. Two schedules would give about 2E.
    t0, seq0 = time.monotonic(), nats_server.stream_last_seq()
    wait_until(lambda: nats_server.stream_last_seq() - seq0 >= 6, what="six firings")
    fired, elapsed = nats_server.stream_last_seq() - seq0, time.monotonic() - t0
    assert fired <= elapsed / 1.0 + 1, f"{fired} firings in {elapsed:.2f}s: the schedule fired more than once a second"
    wait_until(lambda: len(done([a, b], "tick")) >= fired, what="the fired jobs done")
    seqs = [r.seq for r in done([a, b], "tick")]
    assert len(seqs) == len(set(seqs)), "each fired job ran once"
    assert a.stop() == 0 and b.stop() == 0

    # The config drops it: the next start removes its own schedule, and leaves the CLI-made one.
    del a.config["schedules"]
    a.config_path.write_text(tomli_w.dumps(a.config))
    a.start()
    a.wait_event("schedule_removed", schedule="tick")
    assert schedule_names(nats_server.url, tmp_path) == {"byhand": "cli"}
    assert a.stop() == 0


async def stream_without_schedules(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(api.StreamConfig(name="JOBS", subjects=["jobs.>"],
                                                         retention=api.RetentionPolicy.WORK_QUEUE))
    finally:
        await nc.close()


def test_a_stream_made_without_schedules_refuses_them_clearly(nats_server, supervisor_factory, tmp_path):
    asyncio.run(stream_without_schedules(nats_server.url))
    for args in (("publish", "--delay", "1"), ("schedule", "list"), ("schedule", "add", "x", "--every", "5")):
        r = run_cli(*args, "--server", nats_server.url, tmp=tmp_path)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "stream.allow_schedules" in r.stderr and "created without message schedules" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert nats_server.stream_msgs() == 0, "nothing stored that would never fire"

    sup = supervisor_factory(nats_server, workers={"count": 1}, args=JSON_LOGS, schedules=TICK)
    sup.wait_ready()
    refused = sup.wait_event("schedules_refused")
    assert "stream.allow_schedules" in refused["reason"]
    alerts = {a["kind"]: a["message"] for a in sup.status()["alerts"]}
    assert "stream.allow_schedules" in alerts["schedules_refused"]
    publish(nats_server.url, count=2, data="0", tmp=tmp_path)
    wait_until(lambda: len(sup.jobs.done()) == 2, what="jobs still run beside the refusal")
    assert sup.stop() == 0


@pytest.mark.parametrize("args, key", [
    (("publish", "--delay", "-1"), "--delay"),
    (("publish", "--at", "tomorrow"), "--at"),
    (("publish", "--at", "2026-12-01T10:00:00"), "--at"),              # no offset
    (("publish", "--delay", "5", "--subject", "other.x"), "--subject"),
    (("schedule", "add", "x", "--every", "0"), "--every"),
    (("schedule", "add", "x", "--cron", "*/5 * *"), "--cron"),
    (("schedule", "add", "a.b", "--every", "5"), "NAME"),
])
def test_bad_delay_and_schedule_flags_exit_2_naming_the_flag(tmp_path, args, key):
    """Checked before any connection: the server named here does not exist (exit 4 if reached)."""
    r = run_cli(*args, "--server", "nats://127.0.0.1:1", tmp=tmp_path)
    assert r.returncode == 2 and f"error: {key}:" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("entry, key", [
    ('cron = "0 0 30 2 *"', "schedules.s.cron"),
    ("every = 0", "schedules.s.every"),
    ('every = 5\nsubject = "elsewhere.x"', "schedules.s.subject"),
])
def test_bad_schedules_in_the_config_exit_2_naming_the_key(tmp_path, entry, key):
    (tmp_path / "config.toml").write_text(f'[workers]\nhandler = "workers.examples:noop"\n[schedules.s]\n{entry}\n')
    for command in (("config", "check"), ("start", "--http", "")):
        r = run_cli(*command, tmp=tmp_path)
        assert r.returncode == 2 and f"error: {key}:" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_schedule_below_the_ack_floor_is_no_job_the_consumer_gave_up_on(nats_server, supervisor_factory, tmp_path):
    """The parent searches the stream below the consumer's ack floor for jobs given up on while
    no one saw the advisory (monitor.find_given_up), copies them to the dead letters and deletes
    them. A schedule lives there for good (no consumer matches it): taken for such a job, it would
    be dead-lettered and deleted, and stop firing."""
    sup = supervisor_factory(nats_server, workers={"count": 1}, args=JSON_LOGS)
    sup.wait_ready()
    r = run_cli("schedule", "add", "keep", "--every", "3600", "--server", nats_server.url, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    publish(nats_server.url, count=3, data="0", tmp=tmp_path)
    wait_until(lambda: len(sup.jobs.done()) == 3, what="the jobs done")
    wait_until(lambda: (c := nats_server.consumer())["num_ack_pending"] == 0 and c["ack_floor"]["stream_seq"] == 4,
               what="the ack floor past the schedule (stream seq 1)")
    assert sup.stop() == 0
    sup.start()                      # a start searches at its first poll
    sup.wait_ready()
    wait_until(lambda: json.loads(sup.get("/history")[1])["last_seq"] >= 2, what="the first poll's search over")
    assert not sup.events("given_up_found")
    assert schedule_names(nats_server.url, tmp_path) == {"keep": "cli"}
    assert sup.stop() == 0


def test_a_delayed_job_stored_beside_a_lost_one_is_no_job_in_transit(nats_server):
    """The in-transit check (parent/safety/in_transit.py) NAKs the stored messages between what the
    consumer had delivered before a worker died with credits and what it has delivered since.
    A delayed job's schedule stored in that range is no delivery: NAKed by sequence and expected
    back, it would be counted lost and wait in the ledger for a redelivery that never comes."""
    from test_in_transit import lost_on_a_dead_wire

    async def schedule(r) -> None:
        await r.nc.jetstream().publish("_sched.JOBS.at.later", b"", headers={
            "Nats-Schedule": "@at 2099-01-01T00:00:00Z", "Nats-Schedule-Target": "jobs.new"})
    stats, again, seq = asyncio.run(lost_on_a_dead_wire(nats_server.url, before_store=schedule))
    assert again == [(seq, 2)], f"the job on the wire to the dead worker waits for AckWait: {again}"
    assert stats["naked"] == 1, f"the delayed job's schedule was taken for a job in transit: {stats}"


def test_two_starts_that_both_read_no_schedule_store_it_once(nats_server):
    """Two supervisors starting together may both read "no schedule yet" and both write. The write
    is a compare-and-set on the subject's last sequence: the second finds the first one's, the
    same, and keeps it (a rewrite would restart the period); a different one it replaces."""
    from supervisor.config import Config
    from supervisor.config import schedules as sched
    from supervisor.nats import provision, schedules

    async def scenario() -> tuple[list[bool], int, list[bool], str]:
        cfg = Config().replace(schedules=TICK)
        nc = await nats.connect(nats_server.url)
        try:
            await provision.ensure(nc, cfg)
            js = nc.jetstream()
            (msg,) = schedules.wanted(cfg)
            same = [await schedules.put_checked(js, cfg, msg, "schedules.tick", 0) for _ in range(2)]
            info = await js.stream_info("JOBS", subjects_filter=msg.subject)
            other = sched.ScheduleMsg(msg.subject, sched.every_pattern(5), msg.target, b"other")
            changed = [await schedules.put_checked(js, cfg, m, "schedules.tick", 0) for m in (other, msg)]
            stored = await schedules.stored(js, cfg, msg.subject)
            return same, info.state.messages, changed, stored[0].pattern if stored else ""
        finally:
            await nc.close()
    same, copies, changed, pattern = asyncio.run(scenario())
    assert same == [True, False] and copies == 1, "the second writer kept the first one's schedule"
    assert changed == [True, True] and pattern == "@every 1s", "a different schedule is replaced, not kept"


def test_jobs_a_schedule_fired_can_be_dead_lettered_and_replayed(nats_server, supervisor_factory, tmp_path):
    """A fired job carries the server's Nats-Scheduler and Nats-Schedule-Next headers, which a
    client may not publish (the server refuses Next unless it purges, and Scheduler without
    it). Copied as they are, a fired job's dead letter is refused: its Reject becomes a NAK for
    ever; and a replay would be refused, or purge a schedule. One recurring, one delayed job."""
    from test_crash_safety import dead_letters

    sup = supervisor_factory(nats_server, workers={"count": 1},
                             schedules={"bad": {"every": 3600.0, "subject": "jobs.bad", "data": "reject"}})
    sup.wait_ready()
    # @every fires its first time a period after it was stored: `schedule add` of a 1 s one fires now.
    r = run_cli("schedule", "add", "now", "--every", "1", "--data", "reject", "--server", nats_server.url, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    letters = wait_until(lambda: asyncio.run(dead_letters(nats_server.url)), what="the fired job's dead letter")
    assert run_cli("schedule", "rm", "now", "--server", nats_server.url, tmp=tmp_path).returncode == 0
    publish(nats_server.url, count=1, data="reject", tmp=tmp_path, extra=("--delay", "0"))
    letters = wait_until(lambda: len(got := asyncio.run(dead_letters(nats_server.url))) >= 2 and got,
                         what="the delayed job's dead letter")
    assert all(m.headers.get("Supervisor-Dead-Letter-Scheduler", "").startswith("_sched.JOBS.") for m in letters)
    assert not any(k in m.headers for m in letters for k in ("Nats-Scheduler", "Nats-Schedule-Next"))
    r = run_cli("dlq", "replay", "--all", "--subject", "jobs.again", "--server", nats_server.url, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert schedule_names(nats_server.url, tmp_path) == {"bad": "config"}, "the replay purged no schedule"
    assert sup.stop() == 0


def test_a_sighup_that_changes_schedules_applies_them(nats_server, supervisor_factory, tmp_path):
    import signal

    sup = supervisor_factory(nats_server, workers={"count": 1}, args=JSON_LOGS)
    sup.wait_ready()
    sup.config["schedules"] = TICK
    sup.config_path.write_text(tomli_w.dumps(sup.config))
    sup.signal(signal.SIGHUP)
    sup.wait_event("schedule_added", schedule="tick")
    wait_until(lambda: done([sup], "tick"), what="a job the new schedule fired")
    assert sup.status()["schedules"]["added"] == ["tick"]
    assert sup.stop() == 0


def test_a_stream_given_schedules_by_hand_is_used_once_the_consumer_is_narrowed(
        nats_server, supervisor_factory, tmp_path):
    """README's way for an existing stream: turn schedules on in its config. Until a start has
    narrowed the consumer's filter (it took every subject), a schedule would be delivered as a job
    (run at once, its ack deleting it): refused, naming why; after a restart, used."""
    asyncio.run(stream_without_schedules(nats_server.url))
    sup = supervisor_factory(nats_server, workers={"count": 1})
    sup.wait_ready()

    async def turn_on() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            have = (await js.stream_info("JOBS")).config
            have.subjects = [*have.subjects, "_sched.JOBS.>"]
            have.allow_msg_schedules, have.allow_rollup_hdrs = True, True
            await js.update_stream(have)
        finally:
            await nc.close()
    asyncio.run(turn_on())
    r = run_cli("publish", "--delay", "1", "--server", nats_server.url, tmp=tmp_path)
    assert r.returncode == 2 and "consumer workers delivers _sched.JOBS.> too" in r.stderr, r.stderr
    assert sup.stop() == 0
    sup.start()
    sup.wait_ready()
    before = time.time()
    publish(nats_server.url, count=1, data="late", tmp=tmp_path, extra=("--delay", "1"))
    wait_until(lambda: done([sup], "late"), what="the delayed job done")
    assert min(r.t for r in sup.jobs.started() if r.data == "late") >= before + 1.0
    assert sup.stop() == 0
