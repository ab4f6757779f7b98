"""Issue 22 item 5: the NAKs built from a stream sequence alone (the in-transit check,
supervisor/parent/safety/in_transit.py; the re-NAK, Deaths.renak_unseen) NAK whoever holds the job now
(nats-server processNak checks only that the sequence is pending). Each test forces one way such
a NAK could hit a live holder's delivery, or miss a job that was really lost, against a real
nats-server: a peer whose parent is paused or that cannot be heard (R4a), a worker's NAK the
parent has not applied yet (R4b), a stalled loop reading an old PONG (R4c), a death after the
ConsumerInfo (R5a), a replacement slow to start (R5b), a job unread in a stopped worker's socket
(R6), a previous run's Retry(delay) (R12).

AckWait is 60 s throughout: a job back within the test's seconds was someone's NAK.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

import nats
import psutil
from harness import NatsServer, publish, wait_until
from test_promises_peers import beta_runs_alpha_listens, checks, kill_with_credits, runs_of
from test_reliability import catch_in_flight, consumer

from supervisor.config import Config
from supervisor.core.ledger import CrashLedger
from supervisor.nats import provision
from supervisor.nats.fix import Client
from supervisor.parent.safety.in_transit import GIVE_UP, SLACK, InTransit
from supervisor.parent.safety.peers import LISTEN_FIRST, PEER_QUIET, Peers
from workers.protocol import slots
from workers.runtime.puller import PULL_EXPIRES, PULL_MARGIN
from workers.runtime.worker import Worker

ACK_WAIT = 60.0
JSON = ("--log-format", "json")


# ---------------------------------------------------------------- R4a: who is a peer

async def hear(url: str, **connect: object) -> list[Peers]:
    """Two Peers in this one process (one hostname, one pid), each on its own connection, saying
    hello until each has heard the other or LISTEN_FIRST is long past."""
    ncs = [await nats.connect(url, **connect) for _ in range(2)]
    peers = [Peers(nc, "JOBS", "workers", CrashLedger(ACK_WAIT, 3), lambda work: work()) for nc in ncs]
    try:
        for p in peers:
            await p.start()
        deadline = time.monotonic() + LISTEN_FIRST + 10
        while time.monotonic() < deadline:
            for p in peers:
                p.last_hello = 0.0               # hello at every round, not every HELLO_EVERY
                await p.flush()
            if all(p.heard for p in peers) and time.monotonic() - peers[0].listening_since > LISTEN_FIRST:
                break
            await asyncio.sleep(0.05)
        return peers
    finally:
        for nc in ncs:
            await nc.close()


def test_two_supervisors_with_one_hostname_and_pid_are_two_peers(nats_server):
    """Two containers with host networking and the supervisor as PID 1 each had the origin
    `hostname/1`, and each dropped the other's hellos as its own: both took themselves for alone."""
    a, b = asyncio.run(hear(nats_server.url))
    assert a.origin != b.origin
    assert set(a.heard) == {b.origin} and set(b.heard) == {a.origin}
    now = time.monotonic()
    assert a.alone(now) is False and b.alone(now) is False


def test_a_supervisor_that_cannot_hear_itself_is_never_alone(nats_server):
    """no_echo: our own hellos never come back, as when the user may not publish or subscribe
    on supervisor.ledger.> (nats-py only logs that permissions violation). Hearing nobody then
    proves nothing: the supervisor must not take itself for alone."""
    a, b = asyncio.run(hear(nats_server.url, no_echo=True))
    now = time.monotonic()
    assert now - a.listening_since > LISTEN_FIRST
    assert a.alone(now) is False and b.alone(now) is False


DENIED_LEDGER = """
authorization {
  users = [
    {user: admin, password: admin}
    {user: svc, password: svc, permissions: {publish: {deny: ["supervisor.ledger.>"]},
                                             subscribe: {deny: ["supervisor.ledger.>"]}}}
  ]
}
no_auth_user: admin
"""


def test_a_supervisor_denied_the_ledger_subject_runs_no_in_transit_check(tmp_path, supervisor_factory):
    """The supervisor's user may not publish or subscribe on supervisor.ledger.>: it hears no
    peer, and no peer hears it. It must not run the in-transit check (a peer's running jobs
    would be its candidates), however long it listens."""
    conf = tmp_path / "denied.conf"
    conf.write_text(DENIED_LEDGER)
    server = NatsServer(tmp_path / "store", extra_args=("-c", str(conf)), auth=False).start()   # its own users
    try:
        (tmp_path / "pw").write_text("svc\n")
        sup = supervisor_factory(server, args=JSON, consumer={"ack_wait": ACK_WAIT}, workers={"count": 1},
                                 nats={"user": "svc", "password_file": str(tmp_path / "pw")})
        sup.wait_ready(1)
        wait_until(lambda: time.monotonic() - sup_started(sup) > LISTEN_FIRST + 1, what="past LISTEN_FIRST")
        assert sup.status()["peers"]["alone"] is False
        kill_with_credits(sup, server)
        decided = wait_until(lambda: (c := checks(sup))["skipped"] + c["runs"] >= 1 and c, what="the check decided")
        assert decided["runs"] == 0 and "another supervisor" in decided["last_skipped"], decided
        assert sup.stop() == 0
    finally:
        server.stop()


def sup_started(sup) -> float:
    """When the supervisor process started, on this clock (monotonic)."""
    return time.monotonic() - (time.time() - psutil.Process(sup.proc.pid).create_time())


def test_a_peer_whose_parent_is_paused_is_never_taken_for_none(nats_server, supervisor_factory, tmp_path):
    """Beta's worker runs a job; beta's parent is SIGSTOPped (its workers run on) for longer
    than PEER_QUIET. Alpha, which had heard beta, used to take itself for alone then, and NAKed
    beta's running job as lost in transit at its next worker death with credits."""
    gate = tmp_path / "release"
    # The fleet's own release of a silent host's jobs (R10, README) is another net: off here.
    alpha, beta, job = beta_runs_alpha_listens(nats_server, supervisor_factory, gate, fleet={"release_lost": False})
    parent = psutil.Process(beta.proc.pid)
    parent.suspend()
    try:
        paused = time.monotonic()
        wait_until(lambda: time.monotonic() - paused > PEER_QUIET + 1.0, what="beta quiet for longer than PEER_QUIET")
        assert alpha.status()["peers"]["alone"] is False, "a peer heard once counts until it says goodbye"
        kill_with_credits(alpha, nats_server)
        decided = wait_until(lambda: (c := checks(alpha))["skipped"] + c["runs"] >= 1 and c,
                             what="alpha's in-transit check decided")
        alpha.wait_ready(1)
        assert decided["naked"] == 0 and decided["runs"] == 0, decided
        assert alpha.status()["crosscheck"]["in_transit_naked"] == 0
    finally:
        parent.resume()
    gate.touch()
    wait_until(lambda: nats_server.stream_msgs() == 0 and not beta.jobs.running(), what="beta's job done and acked")
    assert runs_of(job.seq, alpha, beta) == [(job.pid, 1)], "beta's running job was handed out again"
    assert beta.stop() == 0
    assert alpha.stop() == 0


# ---------------------------------------------------------------- the check itself, on a real server

class Rig:
    """InTransit on a real server with what the arbiter would give it: tables (a set per worker),
    events queued for the loop, and workers' link proofs."""

    def __init__(self, nc, cfg: Config):
        self.nc, self.cfg = nc, cfg
        self.ledger = CrashLedger(ACK_WAIT, 3)
        self.it = InTransit(cfg, nc, self.ledger)
        self.tables: dict[str, set[int]] = {}
        self.queued: list = []                   # (seq, delivery, kind) events not applied yet

    def fresh_view(self) -> set[int]:
        held = set().union(*self.tables.values())
        for seq, delivery, kind in self.queued:  # as Arbiter.apply_event does
            self.it.named_by_worker(seq, time.monotonic())
            if kind == "nak":
                self.ledger.settled(time.monotonic(), seq, delivery, "nak")
            else:
                self.ledger.redelivered(time.monotonic(), seq, delivery)
        self.queued.clear()
        return held

    async def observe(self) -> None:
        asked = time.monotonic()
        info = await self.nc.jetstream().consumer_info("JOBS", "workers")
        self.it.observed(asked, time.monotonic(), info.delivered.stream_seq, info.num_waiting or 0)

    async def rounds(self, n: int = 4) -> None:
        for _ in range(n):
            await self.it.step(time.monotonic(), self.fresh_view, lambda t: True, True)


async def rig(url: str | list[str], replicas: int = 1) -> Rig:
    """The stream and consumer as the supervisor makes them; `replicas` > 1 on a cluster, made
    here so that the config still says 1 (only ConsumerInfo tells)."""
    cfg = Config().replace(consumer={"ack_wait": ACK_WAIT})
    nc = Client()
    await nc.connect(servers=[url] if isinstance(url, str) else url)
    if replicas > 1:
        js = nc.jetstream()
        await js.add_stream(dataclasses.replace(provision.stream_config(cfg), num_replicas=replicas))
        await js.add_consumer(cfg.stream.name, dataclasses.replace(provision.consumer_config(cfg),
                                                                   num_replicas=replicas))
    await provision.ensure(nc, cfg)
    return Rig(nc, cfg)


async def pull(url: str, n: int = 1) -> tuple[object, list]:
    """A worker's connection with one pull request for `n` out: (connection, messages it got)."""
    nc = await nats.connect(url)
    got: list = []

    async def on_msg(msg):
        if msg.reply:
            got.append(msg)
    inbox = nc.new_inbox()
    await nc.subscribe(inbox, cb=on_msg)
    await nc.publish("$JS.API.CONSUMER.MSG.NEXT.JOBS.workers", b'{"batch":%d,"expires":%d}' % (n, int(30e9)),
                     reply=inbox)
    await nc.flush()
    return nc, got


async def store(url: str, count: int = 1) -> list[int]:
    nc = await nats.connect(url)
    try:
        return [(await nc.jetstream().publish("jobs.new", b"0")).seq for _ in range(count)]
    finally:
        await nc.close()


async def until(done, seconds: float, every: float = 0.01) -> None:
    """Wait until done() is true or `seconds` have passed (the caller asserts what it needs)."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(every)


async def delivered_again(url: str, within: float = 2.0) -> list[tuple[int, int]]:
    """(stream seq, delivery) of whatever a fresh pull gets within `within` seconds."""
    nc, got = await pull(url, 10)
    try:
        await until(lambda: got, within, every=0.02)
        return [(m.metadata.sequence.stream, m.metadata.num_delivered) for m in got]
    finally:
        await nc.close()


async def lost_on_a_dead_wire(url: str, young: bool = False,
                              before_store: Callable[[Rig], Awaitable[None]] | None = None) -> tuple[dict, list, int]:
    """After a reading, a worker pulls, a job is stored and sent to it, and it dies without
    reading it; the rounds run. Its last proof: SLACK after the reading, or (`young`) its fork
    right after the reading. Returns the round's stats, what a fresh pull then gets, the job's seq."""
    r = await rig(url)
    try:
        await r.observe()
        born = time.monotonic()
        proof = born if young else born + SLACK + 0.05
        await until(lambda: time.monotonic() > proof, SLACK + 1)
        dead, got = await pull(url)
        if before_store is not None:
            await before_store(r)
        (seq,) = await store(url)
        await until(lambda: got, 5)                         # on its wire, never read by it
        r.it.death(time.monotonic(), 1, "worker 1 (pid 1)", proof, born=born if young else 0.0)
        await dead.close()
        await r.rounds()
        return dict(r.it.stats), await delivered_again(url), seq
    finally:
        await r.nc.close()


def test_a_worker_nak_the_parent_has_not_applied_yet_is_not_taken_for_lost(nats_server):
    """R4b. Live worker L NAKs job J (no delay) and frees its entry; J goes at once to live
    worker L2, which records it only after the parent's snapshot; both events wait in the
    parent's queue. Meanwhile a dead worker's credits started a round. The snapshot alone showed
    J in no table and not expected: it was NAKed, hitting L2's delivery. The check now applies
    the queued events after the snapshot, right before the NAKs, and leaves alone any job a
    worker named since the round's lower bound."""
    async def scenario() -> tuple[dict, list]:
        r = await rig(nats_server.url)
        try:
            await r.observe()
            dead_read_before = time.monotonic() + SLACK + 0.05
            while time.monotonic() < dead_read_before:      # its last proof is newer than the reading
                await asyncio.sleep(0.01)
            live, got = await pull(nats_server.url)
            (seq,) = await store(nats_server.url)
            wait_for = time.monotonic() + 5
            while not got and time.monotonic() < wait_for:
                await asyncio.sleep(0.01)
            await got[0].nak()                              # L: NAK, entry freed, event queued
            await live.flush()
            live2, got2 = await pull(nats_server.url)       # L2 takes the redelivery ...
            while not got2 and time.monotonic() < wait_for:
                await asyncio.sleep(0.01)
            r.queued += [(seq, 1, "nak"), (seq, 2, "redelivered")]   # ... and records it after the snapshot
            r.it.death(time.monotonic(), 1, "worker 9 (pid 9)", dead_read_before)
            await r.rounds()
            again = await delivered_again(nats_server.url, within=1.0)
            await live.close()
            await live2.close()
            return dict(r.it.stats), again
        finally:
            await r.nc.close()
    stats, again = asyncio.run(scenario())
    assert stats["runs"] == 1 and stats["naked"] == 0, stats
    assert again == [], f"L2's delivery of the job was NAKed: {again}"


def test_a_death_after_the_consumer_info_is_not_dropped(nats_server):
    """R5a. Worker D1 dies with credits; the round reads ConsumerInfo. Then worker D2 dies with
    a message on the wire to it, delivered after that reading: beyond its `delivered`. The round
    used to end with the first reading and zero both deaths' credits: D2's message waited for
    AckWait. A death after the reading now gets a fresh one."""
    async def scenario() -> tuple[dict, list, int]:
        r = await rig(nats_server.url)
        try:
            await r.observe()
            start = time.monotonic() + SLACK + 0.05
            while time.monotonic() < start:
                await asyncio.sleep(0.01)
            d1, _ = await pull(nats_server.url)
            r.it.death(time.monotonic(), 1, "worker 1 (pid 1)", time.monotonic())
            await d1.close()
            await r.it.step(time.monotonic(), r.fresh_view, lambda t: True, True)   # reads ConsumerInfo
            assert r.it.info_at is not None
            d2, got = await pull(nats_server.url)
            (seq,) = await store(nats_server.url)
            await until(lambda: got, 5)
            r.it.death(time.monotonic(), 1, "worker 2 (pid 2)", start)    # it never read the message
            await d2.close()
            await r.rounds()
            return dict(r.it.stats), await delivered_again(nats_server.url), seq
        finally:
            await r.nc.close()
    stats, again, seq = asyncio.run(scenario())
    assert again == [(seq, 2)], f"the message on the wire to the second dead worker waits for AckWait: {again}"
    assert stats["naked"] == 1, stats


def test_a_death_in_a_supervisors_first_moments_is_bounded_by_the_reading_it_started_with(nats_server):
    """Seed 1028: a supervisor's only ConsumerInfo is the one it took at its start; a worker
    forked right after it pulled, the server sent it a job, and it was killed before it read
    it, its last proof within SLACK of that reading. The check skipped ("no ConsumerInfo from
    before the dead worker's last answer from NATS"): the job waited for AckWait. A reading
    answered before the worker's fork bounds it too: the worker had no request out then."""
    stats, again, seq = asyncio.run(lost_on_a_dead_wire(nats_server.url, young=True))
    assert again == [(seq, 2)], f"the job on the young worker's wire waits for AckWait: {again}; {stats}"
    assert stats["naked"] == 1, stats


def test_a_replicated_consumer_gets_no_in_transit_nak(nats_cluster):
    """R4c. On an R3 consumer, ConsumerInfo counts a delivery before its raft commit; the
    message reaches its worker only after the commit, however long a slow follower makes that.
    No SLACK proves it was read, so the check skips, although the dead worker's message would
    have been found (the config says one replica: ConsumerInfo tells)."""
    async def scenario() -> tuple[dict, list]:
        r = await rig(nats_cluster.urls, replicas=3)
        try:
            await r.observe()
            start = time.monotonic() + SLACK + 0.05
            while time.monotonic() < start:
                await asyncio.sleep(0.01)
            dead, got = await pull(nats_cluster.urls[0])
            await store(nats_cluster.urls[0])
            await until(lambda: got, 10)
            r.it.death(time.monotonic(), 1, "worker 1 (pid 1)", start)
            await dead.close()
            await r.rounds()
            return dict(r.it.stats), await delivered_again(nats_cluster.urls[0], within=1.0)
        finally:
            await r.nc.close()
    stats, again = asyncio.run(scenario())
    assert stats["skipped"] == 1 and "replicated" in stats["last_skipped"] and stats["naked"] == 0, stats
    assert again == []


# ---------------------------------------------------------------- R4c: the proof is a PING's send time

def test_a_stalled_loop_reading_an_old_pong_proves_only_what_its_ping_covered(nats_server):
    """The worker's loop stalls right after its liveness PING is written (a blocking handler,
    the GIL, a loaded box); the PONG is read after the stall. The table used to get the PONG's
    arrival time, claiming messages the server wrote after it had answered the PING. It gets
    the PING's send time now."""
    async def scenario() -> tuple[float, float, float]:
        nc = Client()
        await nc.connect(servers=[nats_server.url])
        table = slots.SlotTable(4, 128)
        stalled: list[float] = []

        class Owner:
            pass
        owner = Owner()
        owner.nc, owner.table = nc, table
        owner.pulls = type("P", (), {"sizer": type("S", (), {"round_trip": lambda self, t: None})()})()
        owner.threads = type("T", (), {"collect": lambda self: None})()
        real_flush = nc.flush

        async def flush_then_stall(timeout: float = 2.0) -> None:
            def stall() -> None:                        # runs once the PING is on the socket
                stalled.append(time.monotonic())
                time.sleep(1.0)
                stalled.append(time.monotonic())
            if not stalled:
                asyncio.get_running_loop().call_soon(stall)
            await real_flush(timeout)
        nc.flush = flush_then_stall
        task = asyncio.ensure_future(Worker.liveness(owner))
        while len(stalled) < 2 or table.server_seen() == 0.0:
            await asyncio.sleep(0.01)
        seen = table.server_seen()
        task.cancel()
        await nc.close()
        table.close()
        return seen, stalled[0], stalled[1]
    seen, stall_began, stall_ended = asyncio.run(scenario())
    assert seen < stall_began < stall_ended, (seen, stall_began, stall_ended)


# ---------------------------------------------------------------- R5b: a replacement slow to start

def test_a_slow_starting_replacement_does_not_block_the_in_transit_check(nats_server, supervisor_factory):
    """R5b. The dead worker's replacement is forked 50 ms later and spends GIVE_UP + 1.5 s (6.5 s)
    in workers.init. It has no subscription yet, so it can hold nothing, but it was asked to prove
    what it held: the check gave up after GIVE_UP (5 s) and the message on the wire waited for
    AckWait. (W2, stopped until the replacement exists, keeps the check waiting for that moment.)"""
    sup = supervisor_factory(nats_server, args=JSON, workers={"count": 2, "init": "testhandlers:slow_init"},
                             consumer={"ack_wait": ACK_WAIT}, restart={"backoff_initial": 0.05},
                             env={"SLOW_INIT": str(GIVE_UP + 1.5)})
    sup.wait_ready(2)
    wait_until(lambda: sup.status()["peers"]["alone"], timeout=30, what="the supervisor sure it is alone")
    victim, w2 = (psutil.Process(p.pid) for p in sup.workers())
    w2.suspend()
    frozen = time.monotonic()
    try:
        wait_until(lambda: time.monotonic() - frozen > PULL_EXPIRES + PULL_MARGIN, what="W2's pull request ended")
        seq = catch_in_flight(sup, nats_server, victim)
        killed = time.monotonic()
        victim.kill()
        wait_until(lambda: len(sup.worker_pids() - {w2.pid, victim.pid}) == 1, what="the replacement forked")
    finally:
        w2.resume()
    wait_until(lambda: seq in sup.jobs.done_seqs(), timeout=ACK_WAIT / 3,
               what="the in-transit job redone, long before AckWait")
    assert time.monotonic() - killed < ACK_WAIT / 3
    c = checks(sup)
    assert c["naked"] == 1 and c["skipped"] == 0, c
    assert sup.stop() == 0


# ---------------------------------------------------------------- R12: a previous run's Retry(delay)

def test_a_previous_runs_retry_delay_survives_the_next_runs_in_transit_check(nats_server, supervisor_factory):
    """Run 1's handler answers Retry(300) for job J and run 1 stops. J is pending, stored, held
    by nobody and not in run 2's ledger. At run 2's first worker death with credits, the check
    took J for lost in transit and NAKed it: J ran at once, its delay ignored."""
    same = {"consumer": {"ack_wait": ACK_WAIT}, "workers": {"count": 1}}
    first = supervisor_factory(nats_server, args=JSON, **same)
    first.wait_ready(1)
    publish(nats_server.url, count=1, data="retry:300")
    job = wait_until(lambda: first.jobs.started(), what="J run once")[0]
    wait_until(lambda: first.status()["jobs"]["nak"] == 1, what="J NAKed with its delay")
    assert first.stop() == 0
    second = supervisor_factory(nats_server, args=JSON, **same)
    second.wait_ready(1)
    wait_until(lambda: second.status()["peers"]["alone"], timeout=30, what="run 2 sure it is alone")
    kill_with_credits(second, nats_server)
    decided = wait_until(lambda: (c := checks(second))["skipped"] + c["runs"] >= 1 and c, what="the check decided")
    second.wait_ready(1)
    assert decided["runs"] == 1 and decided["naked"] == 0, decided
    assert second.status()["crosscheck"]["in_transit_naked"] == 0
    assert runs_of(job.seq, first, second) == [(job.pid, 1)]
    assert second.stop() == 0


# ---------------------------------------------------------------- R6: the re-NAK and a stopped worker

def test_no_renak_of_a_job_unread_in_a_stopped_workers_socket(nats_server, supervisor_factory, tmp_path):
    """V dies holding job S; the parent NAKs S, and the server hands it to worker W1's live pull
    request while W1 is SIGSTOPped (its loop blocked): S sits unread in W1's socket, in no table,
    seen by nobody. RENAK_AFTER later the re-NAK NAKed S again, taking it from W1: V's
    replacement ran it, and so did W1 once it went on. No re-NAK while a live worker cannot
    show what it holds."""
    gate = tmp_path / "release"
    sup = supervisor_factory(nats_server, args=JSON, workers={"count": 2}, consumer={"ack_wait": ACK_WAIT},
                             restart={"backoff_initial": 3.0, "backoff_max": 3.0})
    sup.wait_ready(2)
    wait_until(lambda: sup.status()["peers"]["alone"], timeout=30, what="the supervisor sure it is alone")
    publish(nats_server.url, count=1, data=f"until:{gate}")
    seq = wait_until(lambda: sup.jobs.running(), what="S running")[0].seq
    for _ in range(10):
        holder = [r for r in sup.jobs.running() if r.seq == seq][-1].pid
        w1 = psutil.Process(next(pid for pid in sup.worker_pids() if pid != holder))
        wait_until(lambda: consumer(nats_server)["waiting"] >= 1, what="W1's pull request waiting")
        before = consumer(nats_server)["delivered"]
        delivery = max(r.delivery for r in sup.jobs.started() if r.seq == seq) + 1   # S's next, in W1's socket
        w1.suspend()
        psutil.Process(holder).kill()
        killed = time.monotonic()
        # The replacement starts 3 s after the death: S handed out sooner went to W1's request.
        handed = wait_until(lambda: consumer(nats_server)["delivered"] > before or time.monotonic() - killed > 2.5,
                            what="S handed out, or not")
        if consumer(nats_server)["delivered"] > before and time.monotonic() - killed < 2.5 and handed:
            break
        w1.resume()                              # its request had ended: S waits for the next pull; again
        wait_until(lambda: [r for r in sup.jobs.running() if r.seq == seq and r.pid != holder],
                   what="S running again")
        sup.wait_ready(2)
    else:
        raise AssertionError("never had S in a stopped worker's socket")
    try:
        # Once V's replacement pulls (a ConsumerInfo shows its request waiting, so S is not in the
        # redelivery queue), only W1's stalled link is left to stop the re-NAK.
        waiting = wait_until(lambda: [e for e in sup.events("renak_waiting", seq=seq) if "has not shown" in e["why"]],
                             what="the re-NAK held back for W1's stalled link", timeout=20)
        assert not sup.events("renak", seq=seq), waiting
    finally:
        w1.resume()
    wait_until(lambda: [r for r in sup.jobs.running() if r.seq == seq and r.pid == w1.pid], what="W1 runs S")
    gate.touch()
    wait_until(lambda: nats_server.stream_msgs() == 0 and seq in sup.jobs.done_seqs(), what="S done and acked")
    assert [(r.pid, r.delivery) for r in sup.jobs.started() if r.seq == seq][-1:] == [(w1.pid, delivery)]
    assert len([r for r in sup.jobs.done() if r.seq == seq]) == 1, "S ran to completion once"
    assert not sup.events("renak", seq=seq)
    assert sup.stop() == 0
