"""[limits.NAME] and pauses against real servers, supervisors and workers (issue 26): the handlers'
own journals (tests/handlers/testhandlers.py, limithandlers.py) say how many jobs ran at once,
across every supervisor; the logs and /status say why.

The rate over 30 s and more lives in bench (`python -m bench --only limits`, bench/costs/limits.py);
the randomized fault suite draws limits and pauses too (chaos/, docs/RELIABILITY.md)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from datetime import datetime

import nats
import pytest
from harness import publish_now, run_cli, wait_until
from nats.js.errors import KeyNotFoundError
from test_observability import metric_families, value

from bench.costs.limits import most_in_window
from supervisor.nats.limits import held_keys
from workers.protocol.limitkeys import LEASE_TTL, Holder, parse_key

DB = {"db": {"concurrency": 3, "subjects": ["jobs.db.>"]}}


def records(*sups):
    return sorted((r for s in sups for r in s.jobs.records()), key=lambda r: r.t)


def most_at_once(recs, data_prefix: str = "") -> int:
    """The largest number of jobs between their start and done lines at one moment."""
    now = best = 0
    for r in recs:
        if not r.data.startswith(data_prefix):
            continue
        now += 1 if r.event == "start" else -1
        best = max(best, now)
    return best


def busy_time(recs, data_prefix: str = "") -> tuple[float, float]:
    """(seconds of job run time summed, first start to last done) for jobs whose data starts so."""
    starts = {(r.pid, r.seq, r.delivery): r.t for r in recs if r.event == "start" and r.data.startswith(data_prefix)}
    dones = {(r.pid, r.seq, r.delivery): r.t for r in recs if r.event == "done" and r.data.startswith(data_prefix)}
    total = sum(dones[k] - starts[k] for k in dones if k in starts)
    return total, max(dones.values()) - min(starts.values())


def publish_to(url: str, subject: str, datas: list[str]) -> list[int]:
    async def run() -> list[int]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            return [(await js.publish(subject, d.encode())).seq for d in datas]
        finally:
            await nc.close()
    return asyncio.run(run())


def all_done(sups, seqs) -> bool:
    return set(seqs) <= set().union(*(s.jobs.done_seqs() for s in sups))


def slot_holders(servers: str | list[str], name: str = "db", bucket: str = "SUPERVISOR_LIMITS") -> dict[int, Holder]:
    """Each slot of limit `name` held now -> who holds it, by its value in the limits bucket."""
    async def run() -> dict[int, Holder]:
        nc = await nats.connect(servers)
        try:
            js, held = nc.jetstream(), {}
            kv = await js.key_value(bucket)
            for key in await held_keys(js, bucket):
                parsed = parse_key(key)
                if parsed and parsed[:2] == (name, "c"):
                    try:
                        holder = Holder.parse((await kv.get(key)).value or b"")
                    except KeyNotFoundError:
                        continue                # given back meanwhile
                    if holder:
                        held[parsed[2]] = holder
            return held
        finally:
            await nc.close()
    return asyncio.run(run())


# ---------------------------------------------------------------- concurrency across the fleet

def test_two_supervisors_never_run_more_than_the_limit_and_use_all_of_it(nats_server, supervisor_factory):
    """concurrency = 3 shared by two supervisors of 3 workers each (6 handlers): never more than
    3 jobs at once by the journals, at least two thirds of the limit busy on average, and no
    delivery spent on waiting (every job ran at its first delivery)."""
    sups = [supervisor_factory(nats_server, workers={"count": 3}, limits=DB, args=("--log-format", "json"))
            for _ in range(2)]
    for s in sups:
        s.wait_ready()
    seqs = publish_to(nats_server.url, "jobs.db.write", ["0.2"] * 45)
    wait_until(lambda: all_done(sups, seqs), what="45 limited jobs done")
    recs = records(*sups)
    assert most_at_once(recs) == 3, "the limit was never reached or was exceeded"
    busy, span = busy_time(recs)
    assert busy / span >= 2.0, f"the limit was under-used: {busy / span:.2f} of 3 busy on average"
    assert {r.delivery for r in recs} == {1}, "a job waiting for its limit spent a delivery"
    assert {r.pid for r in recs} & {w.pid for w in sups[0].workers()} and \
        {r.pid for r in recs} & {w.pid for w in sups[1].workers()}, "one supervisor took every slot"
    status = sups[0].status()["limits"]["db"]
    assert status["concurrency"] == 3 and status["taken"] > 0 and status["waiting"] == 0


def test_jobs_needing_no_limit_go_past_jobs_waiting_for_one(nats_server, supervisor_factory):
    """Six limited jobs (1 s each, concurrency 3) fill every handler of 6 workers, then 12 short
    free jobs come: the waiting three are parked without a handler, so the free jobs all finish
    before the second round of limited jobs even starts. Waiting inside the handler instead (no
    parking) leaves the free jobs behind the first round."""
    sups = [supervisor_factory(nats_server, workers={"count": 3}, limits=DB) for _ in range(2)]
    for s in sups:
        s.wait_ready()
    db = publish_to(nats_server.url, "jobs.db.write", ["db:1.0"] * 6)
    wait_until(lambda: len(records(*sups)) >= 3, what="the first limited jobs started")
    free = publish_to(nats_server.url, "jobs.free.x", ["free:0.05"] * 12)
    wait_until(lambda: all_done(sups, db + free), what="every job done")
    recs = records(*sups)
    last_free = max(r.t for r in recs if r.event == "done" and r.data.startswith("free"))
    db_starts = sorted(r.t for r in recs if r.event == "start" and r.data.startswith("db"))
    assert last_free < db_starts[3], "free jobs waited behind the limited ones"
    assert most_at_once(recs, "db") == 3


def test_a_slot_is_taken_for_a_job_only_when_a_handler_is_free_to_start_it(nats_server, supervisor_factory,
                                                                            tmp_path):
    """concurrency = 2 over three consumers' supervisors. H holds both slots until the test lets
    them go. A's one worker, its handler idle, holds two limited jobs that wait. The slots free:
    A can start one job, so it takes one slot. B's idle worker then gets a limited job: it takes
    the other slot and starts while A's first job runs. Before: each job A held waiting had a
    take under way, so A took both slots, one for a job queued behind its own handler, and B's
    worker, idle, waited for A's first job to end. (Apart consumers, so that which worker a
    message goes to is not at stake here: only the slots.) Live /metrics limit_* say the same:
    2 in use and 2 waiting at A, 2 taken by H, A's wait seconds growing while it waits; at the
    end 2 taken by A, 1 by B, none waiting."""
    gate = tmp_path / "gate"
    two = {"db": {"concurrency": 2, "subjects": ["jobs.db.>", "jobs.hold"]}}
    h, a, b = (supervisor_factory(nats_server, workers={"count": count}, limits=two,
                                  consumer={"name": name, "filter_subject": subject})
               for name, count, subject in (("h", 2, "jobs.hold"), ("a", 1, "jobs.db.a"), ("b", 1, "jobs.db.b")))
    for s in (h, a, b):
        s.wait_ready()
    publish_to(nats_server.url, "jobs.hold", [f"until:{gate}"] * 2)
    wait_until(lambda: len(h.jobs.started()) == 2, what="H holding both slots")
    first = publish_to(nats_server.url, "jobs.db.a", ["db:1.0"] * 2)
    wait_until(lambda: (db := a.status()["limits"]["db"])["waiting"] == 2 and db["in_use"] == 2
               and h.status()["limits"]["db"]["in_use"] == 2, what="A's two jobs waiting for the limit, both slots in use")
    live = {s: limit_metrics(s) for s in (a, h)}
    assert [(m["in_use"], m["waiting"], m["taken"]) for m in live.values()] == [(2, 2, 0), (2, 0, 2)], live
    # A's waits count while they last, not only when they end (the counter grew at the end only).
    wait_until(lambda: limit_metrics(a)["wait_seconds"] > live[a]["wait_seconds"] + 0.5, 10,
               "A's limit_wait_seconds_total growing while its jobs wait")
    gate.touch()
    wait_until(lambda: a.jobs.started() and h.status()["limits"]["db"]["held_here"] == 0,
               what="H's slots given back, A's first job started")
    [late] = publish_to(nats_server.url, "jobs.db.b", ["db:1.0"])
    wait_until(lambda: all_done([a, b], first + [late]), what="every limited job done")
    recs = [r for r in records(a, b) if r.data.startswith("db:")]
    first_done = min(r.t for r in recs if r.event == "done")
    second_start = sorted(r.t for r in recs if r.event == "start")[1]
    assert second_start < first_done, ("a slot was held for a job no handler could start: the second limited "
                                       f"job started {second_start - first_done:.2f} s after the first was done")
    assert most_at_once(records(a, b, h)) <= 2 and {r.delivery for r in recs} == {1}
    after = {s: limit_metrics(s) for s in (a, b)}
    assert [(m["taken"], m["waiting"]) for m in after.values()] == [(2, 0), (1, 0)], after
    assert after[a]["wait_seconds"] > 0, after


def limit_metrics(sup, name: str = "db") -> dict[str, float]:
    """A supervisor's live /metrics limit_* samples of limit `name` (docs/CONTRACT.md)."""
    code, text = sup.get("/metrics")
    assert code == 200, text
    fams = metric_families(text)
    return {k: value(fams, f"jetstream_supervisor_limit_{k}", limit=name) for k in ("in_use", "waiting", "taken",
                                                                                   "wait_seconds")}


def test_jobs_needing_no_limit_flow_past_several_jobs_waiting_on_an_idle_handler(nats_server, supervisor_factory,
                                                                                  tmp_path):
    """concurrency = 1, held by a job that runs until the test lets it go. Two workers of one
    handler each (a pool): the other worker takes three limited jobs that must wait, then free
    jobs come. Its handler is idle, so it takes them and they run while the limit is still
    full. Before: waiting jobs beyond `workers.concurrency` (here 1) counted as taking its
    handler, so it stopped pulling with the handler idle, and the free jobs waited for the limit
    to free (the pool stalled; the same with several limited jobs brought by one pull)."""
    gate = tmp_path / "gate"
    one = {"db": {"concurrency": 1, "subjects": ["jobs.db.>"]}}
    sup = supervisor_factory(nats_server, workers={"count": 2}, limits=one)
    sup.wait_ready()
    held = publish_to(nats_server.url, "jobs.db.hold", [f"until:{gate}"])
    wait_until(lambda: sup.jobs.started(), what="the limit held")
    limited = publish_to(nats_server.url, "jobs.db.write", ["db:0.05"] * 3)
    wait_until(lambda: sup.status()["limits"]["db"]["waiting"] >= 2, what="limited jobs waiting")
    free = publish_to(nats_server.url, "jobs.free.x", ["free:0.05"] * 10)
    try:
        wait_until(lambda: all_done([sup], free), timeout=15, what="free jobs run while the limit is full")
        assert not [r for r in sup.jobs.records() if r.data.startswith("db:")], "a limited job ran over the cap"
    finally:
        gate.touch()
    wait_until(lambda: all_done([sup], held + limited), what="the limited jobs once the limit frees")
    recs = sup.jobs.records()
    assert most_at_once([r for r in recs if not r.data.startswith("free")]) == 1
    assert {r.delivery for r in recs} == {1}


def test_a_limit_held_for_part_of_a_job(nats_server, supervisor_factory, tmp_path):
    """`with limit("db"):` in a sync handler and `async with` in an async one: the blocks, not
    the jobs, are limited (the jobs' subjects match no limit)."""
    for handler in ("limithandlers:partial", "limithandlers:partial_async"):
        sup = supervisor_factory(nats_server, workers={"count": 3, "handler": handler, "concurrency": 2},
                                 limits={"db": {"concurrency": 2}})
        sup.wait_ready()
        seqs = publish_to(nats_server.url, "jobs.new", ["0.1"] * 20)
        wait_until(lambda: all_done([sup], seqs), what=f"20 jobs done ({handler})")
        assert most_at_once(sup.jobs.records()) == 2, handler
        sup.stop()


def test_a_soft_timeout_while_waiting_in_a_limit_block_gives_its_slot_back(nats_server, supervisor_factory, tmp_path):
    """workers.soft_timeout beside `with limit()`: B waits in the block while A (another consumer's
    supervisor, no soft limit) holds the only slot, so SoftTimeout is raised in B's thread inside
    the wait. The take goes on on the loop; once A is done it could get the slot for nobody. That
    take must end, or its grant go back (before: held and renewed for good, so B's retries and every
    later block waited forever)."""
    gate = tmp_path / "gate"
    db = {"db": {"concurrency": 1}}
    holder = supervisor_factory(nats_server, workers={"count": 1, "handler": "limithandlers:partial"}, limits=db,
                                consumer={"name": "holders", "filter_subject": "jobs.hold"})
    sup = supervisor_factory(nats_server, workers={"count": 1, "handler": "limithandlers:partial", "concurrency": 2,
                                                   "soft_timeout": 0.5, "retry_backoff": [0.2]},
                             limits=db, consumer={"filter_subject": "jobs.new"}, args=("--log-format", "json"))
    holder.wait_ready()
    sup.wait_ready()
    publish_to(nats_server.url, "jobs.hold", [f"until:{gate}"])
    wait_until(lambda: holder.jobs.started(), what="A in its block")
    [b] = publish_to(nats_server.url, "jobs.new", ["0.01"])
    wait_until(lambda: sup.status()["limits"]["db"]["waiting"] == 1, what="B waiting in its block")
    sup.wait_event("soft_timeout", seq=b)       # pending in B's thread, which waits in C for the grant
    gate.touch()
    wait_until(lambda: b in sup.jobs.done_seqs(), timeout=30, what="A done, then B's retry through the block")
    failed = sup.events("handler_failed", seq=b)
    assert failed and failed[0]["error"] == "workers.SoftTimeout", failed
    [c] = publish_to(nats_server.url, "jobs.new", ["0.01"])
    wait_until(lambda: c in sup.jobs.done_seqs(), timeout=30, what="a later block")
    wait_until(lambda: sup.status()["limits"]["db"]["held_here"] == 0, what="no slot held once all is done")
    assert sup.stop() == 0 and holder.stop() == 0


# ---------------------------------------------------------------- autoscaling beside a limit

def test_autoscaling_holds_where_a_limit_binds_and_says_so(nats_server, supervisor_factory):
    """A backlog of jobs that all need `db` (concurrency 2), autoscale from 1 up to 6 workers of
    one handler each: a third worker would only wait for the limit, so the count holds at 2 or
    below (never past it), and /status autoscale says the limit is why. (Without the limit the
    same backlog takes it to 5 or more: test_autoscale.py.)"""
    two = {"db": {"concurrency": 2, "subjects": ["jobs.db.>"]}}
    sup = supervisor_factory(nats_server, workers={"count": 1}, limits=two, monitor={"interval": 0.25},
                             autoscale={"enabled": True, "min": 1, "max": 6, "interval": 0.25},
                             args=("--log-format", "json"))
    sup.wait_ready()
    publish_to(nats_server.url, "jobs.db.write", ["0.1"] * 400)      # 20 s of work at 2 at a time
    a = wait_until(lambda: (a := sup.status()["autoscale"])["kind"] == "limit" and a, timeout=40,
                   what="autoscale holding for the limit")
    assert "limit db is full (2/2 in use" in a["reason"], a
    done = len(sup.jobs.done())
    wait_until(lambda: len(sup.jobs.done()) >= done + 40, what="40 more jobs (8 decisions) while it holds")
    targets = [sup.config["workers"]["count"], *(e["to"] for e in sup.events("scaling"))]
    assert max(targets) <= 2, f"workers added that could only wait for the limit: {targets}"
    assert sup.status()["workers"]["target"] <= 2
    assert most_at_once(sup.jobs.records()) <= 2


# ---------------------------------------------------------------- a worker that dies holding a slot

def test_a_worker_killed_holding_a_slot_frees_it_at_once(nats_server, supervisor_factory, tmp_path):
    """concurrency = 1: a job holds the slot until the test lets it go; its worker is SIGKILLed.
    The parent releases the dead worker's slot (event limit_released naming its pid), so the
    job, NAKed and redelivered, takes the slot again well before the slot's own TTL would have
    freed it."""
    gate = tmp_path / "gate"
    sup = supervisor_factory(nats_server, workers={"count": 2}, limits={"db": {"concurrency": 1,
                                                                              "subjects": ["jobs.db.>"]}},
                             args=("--log-format", "json"))
    sup.wait_ready()
    publish_to(nats_server.url, "jobs.db.write", [f"until:{gate}"])
    first = wait_until(lambda: sup.jobs.started(), what="the job started")[0]
    killed_at = time.time()
    os.kill(first.pid, signal.SIGKILL)
    released = sup.wait_event("limit_released", worker_pid=first.pid)
    assert released["released"] == ["db slot 0"]
    again = wait_until(lambda: [r for r in sup.jobs.started() if r.delivery == 2], what="the job ran again")[0]
    assert again.t - killed_at < LEASE_TTL, "the slot came back only by its TTL"
    gate.write_text("go")
    wait_until(lambda: sup.jobs.done(), what="the job done")
    s = wait_until(lambda: (st := sup.status())["limits"]["db"]["in_use"] == 0 and st, what="the slot free")
    assert s["limits"]["db"]["waiting"] == 0


def test_a_host_that_dies_holding_a_slot_frees_it_by_the_ttl_and_loses_nothing(nats_server, supervisor_factory,
                                                                                   tmp_path):
    """Two supervisors on one consumer, concurrency = 1. One's job holds the slot (on a gate);
    that supervisor's whole process group is SIGKILLed, as a host lost: no parent is left to
    release the slot, so only its TTL frees it. The other's job, waiting for the limit, starts
    within LEASE_TTL (plus a margin for a loaded box) of the kill; the killed job comes back
    after AckWait (3 s) and runs there too; nothing is lost, and never two at once."""
    gate = tmp_path / "gate"
    one = {"db": {"concurrency": 1, "subjects": ["jobs.db.>"]}}
    sups = [supervisor_factory(nats_server, workers={"count": 1}, limits=one, consumer={"ack_wait": 3.0})
            for _ in range(2)]
    for s in sups:
        s.wait_ready()
    [held] = publish_to(nats_server.url, "jobs.db.write", [f"until:{gate}"])
    [first] = wait_until(lambda: [r for r in records(*sups) if r.event == "start"], what="the gated job started")
    lost, survivor = sups if first.pid in sups[0].worker_pids() else sups[::-1]
    [later] = publish_to(nats_server.url, "jobs.db.write", ["0"])
    wait_until(lambda: survivor.status()["limits"]["db"]["waiting"] == 1, what="the other's job waiting for the slot")
    holders = slot_holders(nats_server.url)
    assert {k: (h.parent, h.pid) for k, h in holders.items()} == {0: (lost.proc.pid, first.pid)}, holders
    assert not survivor.jobs.records(), "a limited job ran on the survivor while the slot was held"
    os.killpg(lost.proc.pid, signal.SIGKILL)
    killed_at = time.time()
    lost.proc.wait()
    gate.touch()                                     # the job's next run, on the survivor, ends at once
    wait_until(lambda: all_done([survivor], [held, later]), timeout=LEASE_TTL + 30, what="both jobs done on the survivor")
    recs = survivor.jobs.records()
    took = min(r.t for r in recs if r.event == "start") - killed_at
    # Not a speed target: a bound that tells the lease's TTL (10 s) from anything longer (a slot
    # left for good, an AckWait-scale wait), with room for a loaded box.
    assert took < LEASE_TTL + 10, f"the dead host's slot freed {took:.1f} s after the kill, not by its TTL"
    assert [r.delivery for r in recs if r.seq == held and r.event == "start"] == [2], "the killed job did not run again"
    assert most_at_once(recs) == 1
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked")
    assert survivor.stop() == 0


# ---------------------------------------------------------------- rate

def test_rate_bounds_starts_in_every_second(nats_server, supervisor_factory):
    """rate = 10 shared by two supervisors: in no one-second window more than 10 starts taken, by
    the server's timestamp of each start key (the bound itself: the server's clock decides), and
    the rate is used (40 jobs in about 4 s). Not by the handlers' stamps: each comes after its
    take by the worker's loop, queue and a thread, and on a loaded box that lag varies by more
    than any fixed allowance (50 ms was exceeded at a load of 10: 11 stamps in 0.95 s, on main
    too). The journal still shows every job ran once."""
    rate = {"api": {"rate": 10.0, "subjects": ["jobs.api.>"]}}
    sups = [supervisor_factory(nats_server, workers={"count": 3, "concurrency": 4}, limits=rate) for _ in range(2)]
    for s in sups:
        s.wait_ready()
    with StartKeys(nats_server.url, "SUPERVISOR_LIMITS", "api") as keys:
        seqs = publish_to(nats_server.url, "jobs.api.call", ["0"] * 40)
        wait_until(lambda: all_done(sups, seqs), what="40 rate-limited jobs done")
        wait_until(lambda: len(keys.stamps) >= 40, what="every start key seen")
    taken = sorted(keys.stamps)
    assert most_in_window(taken, 1.0) <= 10
    assert taken[-1] - taken[0] >= 3.0, "40 starts at 10/s take 3 s at least"
    assert sorted(r.seq for r in records(*sups) if r.event == "start") == sorted(seqs)


class StartKeys:
    """The server's timestamp of every start key of limit `name` written while inside: an ordered
    consumer on the limits bucket, on a loop in a thread of its own (a key's TTL removes it within
    its window, so it is watched as it is written, not read after)."""

    def __init__(self, url: str, bucket: str, name: str):
        self.url, self.subject = url, f"$KV.{bucket}.{name}.r.*"
        self.stamps: list[float] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> StartKeys:
        from nats.js.api import DeliverPolicy

        async def watch() -> nats.NATS:
            nc = await nats.connect(self.url)
            await nc.jetstream().subscribe(self.subject, cb=self.seen, ordered_consumer=True,
                                           deliver_policy=DeliverPolicy.NEW)
            return nc
        self.thread.start()
        self.nc = asyncio.run_coroutine_threadsafe(watch(), self.loop).result(timeout=10)
        return self

    async def seen(self, msg) -> None:
        self.stamps.append(msg.metadata.timestamp.timestamp())

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.nc.close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


# ---------------------------------------------------------------- pause

def rfc3339_to_epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def test_pause_from_a_handler_stops_every_supervisor_and_resumes_by_itself(nats_server, supervisor_factory):
    """A handler raises Pause(3, reason): the consumer is paused until then for both supervisors
    (no job published meanwhile starts before the pause ends, by the journals), /status says
    until when and why, /healthz stays 200, and work resumes by itself. The pausing job itself is
    NAKed with the pause's delay, also past retry.republish_after (1 s here): never re-published
    as a copy for later (it runs again as delivery 2 of its own sequence)."""
    sups = [supervisor_factory(nats_server, workers={"count": 2, "handler": "limithandlers:pauser"},
                               retry={"republish_after": 1.0}, args=("--log-format", "json")) for _ in range(2)]
    for s in sups:
        s.wait_ready()
    [pausing] = publish_to(nats_server.url, "jobs.new", ["pause:3"])
    status = wait_until(lambda: (st := sups[1].try_status()) and st["paused_until"] and st, what="paused on /status")
    until = rfc3339_to_epoch(status["paused_until"])
    assert status["pause_reason"] == "the database is down (test)"
    assert status["headline"]["state"] == "paused"
    seqs = publish_to(nats_server.url, "jobs.new", ["0"] * 6)
    assert sups[0].get("/healthz")[0] == 200
    wait_until(lambda: all_done(sups, seqs), what="work resumed after the pause")
    starts = [r for r in records(*sups) if r.event == "start"]
    assert min(r.t for r in starts) >= until, "a job started while the consumer was paused"
    for s in sups:
        s.wait_event("consumer_paused")
        wait_until(lambda s=s: s.events("consumer_resumed"), what="resume logged")
    wait_until(lambda: all_done(sups, [pausing]), what="the pausing job run again")
    assert [r.delivery for r in records(*sups) if r.seq == pausing and r.event == "start"] == [2]


def test_pause_and_resume_from_the_command_line(nats_server, supervisor_factory, tmp_path):
    """`pause` until `resume`, then `pause --for 5`: no job starts before the server's PauseUntil
    (by the journal over the whole pause), then they run without a `resume`, and the supervisor
    logs the pause's end (consumer_resumed)."""
    sup = supervisor_factory(nats_server, workers={"count": 1}, args=("--log-format", "json"))
    sup.wait_ready()
    cfg = tmp_path / "cli.toml"
    cfg.write_text(f'[nats]\nservers = ["{nats_server.url}"]\n')
    r = run_cli("pause", "--config", str(cfg), "--reason", "deploying the API", tmp=tmp_path)
    assert r.returncode == 0 and "until `supervisor resume`" in r.stdout, r.stderr
    # The pause and its reason reach /status on their own polls (the consumer's state, the bucket's key).
    wait_until(lambda: (st := sup.status())["paused_until"] and st["pause_reason"] == "deploying the API",
               what="paused, with its reason")
    seqs = publish_now(nats_server.url, count=3)
    r = run_cli("pause", "--config", str(cfg), "--for", "5", tmp=tmp_path)      # never shortens a pause
    assert r.returncode == 0 and "already paused" in r.stdout, r.stdout
    assert not sup.jobs.started()
    r = run_cli("resume", "--config", str(cfg), tmp=tmp_path)
    assert r.returncode == 0 and "resumed" in r.stdout, r.stderr
    wait_until(lambda: all_done([sup], seqs), what="jobs after the resume")
    wait_until(lambda: sup.status()["paused_until"] is None, what="resumed on /status")
    before = time.time()
    # 5 s: the CLI's exit, the publish and /status's next poll of the consumer all fall inside the
    # pause on a loaded box (with 2 s a slow CLI exit could leave the jobs after its end).
    r = run_cli("pause", "--config", str(cfg), "--for", "5", "--reason", "a short break", tmp=tmp_path)
    assert r.returncode == 0 and "(5s): a short break" in r.stdout, r.stdout + r.stderr
    seqs = publish_now(nats_server.url, count=3)
    published = time.time()
    until_text = wait_until(lambda: sup.status()["paused_until"], what="the pause's end on /status (the server's)")
    until = rfc3339_to_epoch(until_text)
    assert published < until, "the jobs came after the pause's end: it held nothing back"
    wait_until(lambda: all_done([sup], seqs), what="jobs after the pause, without a resume")
    starts = [r.t for r in sup.jobs.started() if r.t > before]
    assert len(starts) == 3 and min(starts) >= until, f"a job started {until - min(starts):.2f} s before the pause's end"
    paused = [i for i, e in enumerate(sup.events()) if e["event"] == "consumer_paused" and e["until"] == until_text]
    assert paused, "the pause was not logged (consumer_paused with the server's PauseUntil)"
    wait_until(lambda: [e for e in sup.events()[paused[0]:] if e["event"] == "consumer_resumed"],
               what="the pause's end logged")
    r = run_cli("pause", "--config", str(cfg), "--for", "-1", tmp=tmp_path)
    assert r.returncode == 2 and "--for" in r.stderr


# ---------------------------------------------------------------- the bucket away

def test_without_its_bucket_a_limited_job_waits_and_never_runs_unlimited(nats_server, supervisor_factory):
    """The limits bucket deleted under a running supervisor: limited jobs wait (a warning says
    why, /status alerts), free jobs still run; the bucket back, the limited jobs run."""
    sup = supervisor_factory(nats_server, workers={"count": 2}, limits=DB, args=("--log-format", "json"))
    sup.wait_ready()

    async def bucket(create: bool) -> None:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            if create:
                await js.create_key_value(bucket="SUPERVISOR_LIMITS", history=1)
            else:
                await js.delete_key_value("SUPERVISOR_LIMITS")
        finally:
            await nc.close()
    asyncio.run(bucket(create=False))
    limited = publish_to(nats_server.url, "jobs.db.write", ["db:0"] * 3)
    sup.wait_event("limit_unavailable", limit="db")
    free = publish_to(nats_server.url, "jobs.free.x", ["free:0"] * 3)
    wait_until(lambda: all_done([sup], free), what="free jobs run while the bucket is away")
    assert not [r for r in sup.jobs.records() if r.data.startswith("db")], "a limited job ran without its limit"
    kinds = {a["kind"] for a in wait_until(lambda: sup.status()["alerts"] or None, what="an alert")}
    assert "limits_unavailable" in kinds
    asyncio.run(bucket(create=True))
    wait_until(lambda: all_done([sup], limited), what="limited jobs run once the bucket is back")
    assert {r.delivery for r in sup.jobs.records()} == {1}


# ---------------------------------------------------------------- beside recycling and a drain

def test_limits_beside_recycling_and_concurrency(nats_server, supervisor_factory):
    """Workers recycled every 2 jobs, 2 handlers each, concurrency 1 across them: still one at a
    time, every job at its first delivery (a retiring worker runs what it parked), and the slot
    free at the end."""
    one = {"db": {"concurrency": 1, "subjects": ["jobs.db.>"]}}
    sup = supervisor_factory(nats_server, workers={"count": 2, "concurrency": 2, "max_jobs": 2}, limits=one)
    sup.wait_ready()
    seqs = publish_to(nats_server.url, "jobs.db.write", ["0.05"] * 12)
    wait_until(lambda: all_done([sup], seqs), what="12 jobs done through recycling")
    recs = sup.jobs.records()
    assert most_at_once(recs) == 1 and {r.delivery for r in recs} == {1}
    assert len({r.pid for r in recs}) >= 4, "workers were not recycled"
    wait_until(lambda: sup.status()["limits"]["db"]["in_use"] == 0, what="the slot free")


def test_a_drain_gives_back_parked_jobs_and_their_limits(nats_server, supervisor_factory):
    """SIGTERM while jobs wait for the limit: the supervisor exits 0, what waited is NAKed (not
    run), what ran gave its slot back; a new supervisor runs the rest, one at a time."""
    one = {"db": {"concurrency": 1, "subjects": ["jobs.db.>"]}}
    first = supervisor_factory(nats_server, workers={"count": 3}, limits=one)
    first.wait_ready()
    seqs = publish_to(nats_server.url, "jobs.db.write", ["0.5"] * 6)
    wait_until(lambda: first.jobs.started() and first.status()["limits"]["db"]["waiting"] >= 2,
               what="jobs waiting for the limit")
    assert first.stop() == 0
    second = supervisor_factory(nats_server, workers={"count": 3}, limits=one)
    wait_until(lambda: all_done([first, second], seqs), what="every job done by the second supervisor")
    assert most_at_once(records(first, second)) == 1
    wait_until(lambda: second.status()["limits"]["db"]["in_use"] == 0, what="the slot free")


def test_limits_beside_the_idempotency_guard(nats_server, supervisor_factory):
    """[idempotency] inside [limits]: three copies of one job (one key) and three others, a cap
    of 1. The first copy runs; the other two get the slot in turn, are acked as duplicates
    without running, and give the slot back: still one at a time, all at delivery 1, the slot
    free at the end."""
    one = {"db": {"concurrency": 1, "subjects": ["jobs.db.>"]}}
    sup = supervisor_factory(nats_server, workers={"count": 2}, limits=one, idempotency={"enabled": True})
    sup.wait_ready()

    async def publish_copies() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            for k in range(6):
                key = {"Supervisor-Key": "same"} if k % 2 == 0 else None
                await js.publish("jobs.db.write", b"0.1", headers=key)
        finally:
            await nc.close()
    asyncio.run(publish_copies())
    status = wait_until(lambda: (st := sup.status())["jobs"]["duplicate"] == 2 and st["jobs"]["ack"] == 4 and st,
                        what="two copies acked as duplicates, four jobs run")
    recs = sup.jobs.records()
    assert len(sup.jobs.started()) == 4 and most_at_once(recs) == 1 and {r.delivery for r in recs} == {1}
    wait_until(lambda: sup.status()["limits"]["db"]["in_use"] == 0, what="the slot free")
    assert status["limits"]["db"]["waiting"] == 0


def test_limits_through_a_reconnect(nats_server, supervisor_factory):
    """The server restarted while jobs hold and wait for a cap of 1: the workers reconnect, the
    slot their jobs held is kept or taken again, never two at once, every job done, the slot free
    at the end."""
    one = {"db": {"concurrency": 1, "subjects": ["jobs.db.>"]}}
    sup = supervisor_factory(nats_server, workers={"count": 2}, limits=one)
    sup.wait_ready()
    seqs = publish_to(nats_server.url, "jobs.db.write", ["0.2"] * 6)
    wait_until(lambda: len(sup.jobs.done()) >= 2, what="jobs running through the limit")
    nats_server.stop()
    nats_server.start()
    wait_until(lambda: all_done([sup], seqs), timeout=60, what="every job done after the reconnect")
    assert most_at_once(sup.jobs.records()) == 1
    wait_until(lambda: (st := sup.try_status()) and st["limits"]["db"]["in_use"] == 0, what="the slot free")


# ---------------------------------------------------------------- the dashboard

def test_the_dashboard_shows_limits_in_use_and_a_pause_in_chromium(nats_server, supervisor_factory, tmp_path):
    import pytest
    from browser import Browser, chromium_binary

    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed: the dashboard was not rendered in a browser")
    gate = tmp_path / "gate"
    one = {"db": {"concurrency": 1, "subjects": ["jobs.db.>"]}, "api": {"rate": 2.5}}
    sup = supervisor_factory(nats_server, workers={"count": 3}, limits=one)
    sup.wait_ready()
    publish_to(nats_server.url, "jobs.db.write", [f"until:{gate}"] * 3)
    wait_until(lambda: (db := sup.status()["limits"]["db"])["in_use"] == 1 and db["waiting"] == 2, what="1 held, 2 wait")
    cfg = tmp_path / "cli.toml"
    cfg.write_text(f'[nats]\nservers = ["{nats_server.url}"]\n')
    assert run_cli("pause", "--config", str(cfg), "--for", "600", "--reason", "db maintenance").returncode == 0
    wait_until(lambda: sup.status()["headline"]["state"] == "paused", what="paused on /status")
    b = Browser(binary)
    try:
        page = b.new_page(1000, 1200)
        page.goto(f"http://{sup.http}/")
        page.wait_for("Number(document.body.dataset.renders) >= 2", what="two renders")
        assert page.evaluate("document.getElementById('limits').hidden") is False
        rows = page.evaluate("Array.from(document.querySelectorAll('#limits-table tbody tr'), "
                             "r => Array.from(r.cells, c => c.textContent))")
        assert rows == [["db", "1 / 1", "none", "2", rows[0][4]], ["api", "no cap", "0 / 5 per 2.0 s", "0", rows[1][4]]]
        assert page.evaluate("document.getElementById('hl-word').textContent") == "Paused"
        assert "db maintenance" in page.evaluate("document.getElementById('hl-reason').textContent")
        page.screenshot(tmp_path / "dashboard-limits.png")
    finally:
        b.close()
        gate.write_text("go")
        run_cli("resume", "--config", str(cfg))


# ---------------------------------------------------------------- a server that forgot what it delivered

def test_a_parked_job_delivered_again_at_delivery_1_runs_and_gives_its_slot_back(nats_server, supervisor_factory,
                                                                                 tmp_path):
    """The consumer deleted and made again (what a server that lost the consumer's state does):
    every unacked job comes again at delivery 1, here to the worker where its first delivery is
    still parked for the limit. Both deliveries run (the rerun is the server's loss), and every
    slot comes back. Before (parked jobs kept by seq and delivery): the second delivery
    overwrote the first's entry and was never admitted, held for good."""
    gate = tmp_path / "gate"
    one = {"db": {"concurrency": 1, "subjects": ["jobs.db.>"]}}
    sup = supervisor_factory(nats_server, workers={"count": 1, "concurrency": 2}, limits=one)
    sup.wait_ready()
    a, b = publish_to(nats_server.url, "jobs.db.write", [f"until:{gate}", "0"])
    wait_until(lambda: sup.jobs.started() and sup.status()["limits"]["db"]["waiting"] == 1, what="A runs, B waits")

    async def forget() -> None:
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            info = await js.consumer_info("JOBS", "workers")
            await js.delete_consumer("JOBS", "workers")
            await js.add_consumer("JOBS", config=info.config)
        finally:
            await nc.close()
    asyncio.run(forget())
    wait_until(lambda: sup.status()["limits"]["db"]["waiting"] == 3, what="A and B parked again at delivery 1")
    gate.touch()
    wait_until(lambda: sum(r.seq == b for r in sup.jobs.done()) == 2, what="both deliveries of B run")
    wait_until(lambda: (db := sup.status()["limits"]["db"])["in_use"] == 0 and db["held_here"] == 0
               and db["waiting"] == 0, what="every slot given back")


# ---------------------------------------------------------------- a renewal on its way (one worker's Limiter, in-process)

async def limiter_on(url: str):
    from supervisor.config import Config
    from supervisor.nats.provision import ensure_limits_bucket
    from workers.middleware.limits import Limiter

    nc = await nats.connect(url)
    cfg = Config().replace(limits={"db": {"concurrency": 1}})
    await ensure_limits_bucket(nc.jetstream(), cfg)
    return nc, cfg, await Limiter(nc, asyncio.get_running_loop(), cfg, 0, None).start()


def test_a_renewal_answered_after_the_slot_was_given_back_leaves_it_free(nats_server, monkeypatch):
    """The job gives its slot back while the slot's renewal is on its way: the release purges
    below the revision it knew, and the renewal, landed first, wrote a newer one. That one is
    purged too (before: the slot stayed held by nobody until its TTL, 10 s)."""
    import workers.middleware.limits as limits_mod
    from supervisor.nats.limits import held_keys

    async def run() -> dict:
        nc, cfg, limiter = await limiter_on(nats_server.url)
        gate = limiter.gate("db")
        grant = await gate.take()
        k = grant.slot
        gate.wanted()                                   # a worker elsewhere waits: the give-back releases
        real = limits_mod.kv_write

        async def answered_after_the_give_back(*args, **kwargs):
            revision = await real(*args, **kwargs)
            gate.give_back(grant)                       # the job ends as the answer is on its way
            await asyncio.gather(*limiter.tasks)        # its release: a purge below the old revision
            return revision
        monkeypatch.setattr(limits_mod, "kv_write", answered_after_the_give_back)
        await limiter.renew(gate, k, gate.held[k])
        monkeypatch.setattr(limits_mod, "kv_write", real)
        await asyncio.gather(*limiter.tasks)
        try:
            return await held_keys(nc.jetstream(), cfg.fleet.limits_bucket)
        finally:
            await limiter.close()
            await nc.close()
    assert asyncio.run(run()) == {}, "the slot stays held by nobody until its TTL"


@pytest.mark.parametrize("given_back", [False, True], ids=["held", "given-back-while-read"])
def test_a_renewal_that_landed_but_timed_out_is_not_a_lost_slot(nats_server, monkeypatch, given_back):
    """A renewal the server wrote but whose answer timed out: the next one (from the old
    revision) conflicts. The slot is still this worker's (its value says so): it is renewed from
    the newer revision, no `limit_slot_lost` (before: dropped as lost while the job ran on, so
    it expired and a second job could take it). Given back while the conflict's read is out:
    not taken up again (held and renewed by nobody's job for good), but purged up to that
    newer revision."""
    import workers.middleware.limits as limits_mod
    from supervisor.nats.limits import held_keys

    async def run() -> tuple[int, bool, dict]:
        nc, cfg, limiter = await limiter_on(nats_server.url)
        gate = limiter.gate("db")
        gate.wanted()                                   # a worker elsewhere waits: the give-back releases
        grant = await gate.take()
        k, old = grant.slot, gate.held[grant.slot]
        real, read = limits_mod.kv_write, limiter.ours_at

        async def lands_then_times_out(*args, **kwargs):
            await real(*args, **kwargs)
            raise TimeoutError("no answer in time")

        async def given_back_while_read(key):
            revision = await read(key)
            gate.give_back(grant)
            await asyncio.gather(*limiter.tasks)
            return revision
        monkeypatch.setattr(limits_mod, "kv_write", lands_then_times_out)
        await limiter.renew(gate, k, old)
        monkeypatch.setattr(limits_mod, "kv_write", real)
        if given_back:
            monkeypatch.setattr(limiter, "ours_at", given_back_while_read)
        await limiter.renew(gate, k, gate.held[k])
        renewed = gate.held.get(k, 0) > old + 1
        lost = limiter.lost
        gate.give_back(grant)
        await asyncio.gather(*limiter.tasks)
        try:
            return lost, renewed, await held_keys(nc.jetstream(), cfg.fleet.limits_bucket)
        finally:
            await limiter.close()
            await nc.close()
    lost, renewed, keys = asyncio.run(run())
    assert (lost, renewed, keys) == (0, not given_back, {}), (lost, renewed, keys)


def test_a_take_out_when_the_worker_exits_leaves_no_slot_behind(nats_server, monkeypatch):
    """The worker exits (Limiter.close) while a take's create is out: the server wrote the slot,
    its answer is on its way. The take is let finish and the slot given back; before, the take
    was cancelled and the slot held by nobody until its TTL (a recycled worker's exit stalled a
    cap of 1 for 10 s: `python -m chaos --random --seed 56`)."""
    import workers.middleware.limits as limits_mod
    from supervisor.nats.limits import held_keys

    async def run() -> dict:
        nc, cfg, limiter = await limiter_on(nats_server.url)
        gate, real, landed = limiter.gate("db"), limits_mod.kv_write, asyncio.Event()

        async def answered_late(*args, **kwargs):
            revision = await real(*args, **kwargs)
            landed.set()
            await asyncio.sleep(0.3)
            return revision
        monkeypatch.setattr(limits_mod, "kv_write", answered_late)
        waiter = asyncio.ensure_future(gate.take())
        await landed.wait()
        waiter.cancel()                                 # its parked job given back (Limits.close)
        await limiter.close()
        try:
            return await held_keys(nc.jetstream(), cfg.fleet.limits_bucket)
        finally:
            await nc.close()
    assert asyncio.run(run()) == {}, "a slot left held by nobody until its TTL"
