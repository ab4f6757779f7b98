"""[ordering] against real servers, supervisors and workers (issue 27): the handlers' own journal
(tests/handlers/testhandlers.py, `start|done pid seq delivery time data`) says, per key, whether
any job started before the previous one of its key had ended (chaos/order.py judges), whether
anything was lost, and how many jobs ran at once (keys in parallel, not one by one).

The throughput against keys and workers lives in bench (`python -m bench --only ordering`); the
randomized fault suite draws [ordering] too (chaos/, docs/RELIABILITY.md)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import nats
import psutil
import pytest
import tomli_w
from browser import Browser, chromium_binary
from harness import dead_letter_headers, run_cli, wait_until
from nats.js.api import DiscardPolicy, RetentionPolicy, StreamConfig

from chaos.order import Run, overlap, reorders

ORDERED = {"key": "subject:2"}
HANDLER = "testhandlers:record_raises"      # journals the end of a run that raised (a retry) too


def publish_keyed(url: str, jobs: list[tuple[str, str]]) -> list[int]:
    """Store (subject, data) jobs in this order; their stream sequences."""
    async def run() -> list[int]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            return [(await js.publish(subject, data.encode())).seq for subject, data in jobs]
        finally:
            await nc.close()
    return asyncio.run(run())


def keyed_jobs(rng: random.Random, n: int, keys: int, longest: float, prefix: str = "k") -> list[tuple[str, str]]:
    return [(f"jobs.{prefix}{rng.randrange(keys)}", f"{rng.random() * longest:.4f}") for _ in range(n)]


def runs_of(*sups) -> list[Run]:
    """Every run in the supervisors' journals: start and done (or raised) lines paired by (pid, seq,
    delivery)."""
    starts, ends = {}, {}
    for s in sups:
        for r in s.jobs.records():
            (starts if r.event == "start" else ends)[(r.pid, r.seq, r.delivery)] = r.t
    return [Run(seq, pid, delivery, t, ends.get((pid, seq, delivery))) for (pid, seq, delivery), t in starts.items()]


def done(*sups) -> set[int]:
    return set().union(*(s.jobs.done_seqs() for s in sups))


def assert_in_order(runs: list[Run], key_of: dict[int, str], died: dict[int, float] | None = None) -> None:
    bad = reorders(runs, key_of, died)
    assert not bad, f"{len(bad)} job(s) out of order per key, e.g. " + "; ".join(r.describe() for r in bad[:5])


def most_keys_at_once(runs: list[Run], key_of: dict[int, str]) -> int:
    """The most distinct keys whose jobs ran at one moment."""
    edges = sorted([(r.start, 1, key_of[r.seq]) for r in runs if r.end is not None] +
                   [(r.end, -1, key_of[r.seq]) for r in runs if r.end is not None])
    running: dict[str, int] = {}
    best = 0
    for _, step, key in edges:
        running[key] = running.get(key, 0) + step
        best = max(best, sum(1 for n in running.values() if n > 0))
    return best


def kill_a_running_worker(sup, rng: random.Random, died: dict[int, float]) -> int | None:
    """SIGKILL a worker of `sup` that is running a job now (its time of death noted)."""
    running = {r.pid for r in sup.jobs.running()} & sup.worker_pids()
    if not running:
        return None
    pid = rng.choice(sorted(running))
    os.kill(pid, signal.SIGKILL)
    died[pid] = time.time()
    return pid


# ---------------------------------------------------------------- order, parallelism, worker deaths

def test_keys_keep_their_order_through_worker_kills_and_run_in_parallel(nats_server, supervisor_factory):
    """1000 jobs over 20 keys (0-30 ms each) on 3 workers of 2 handlers, a running worker SIGKILLed
    at a quarter, half and three quarters done. Per key no job starts before the previous one of
    its key ended (a killed run ended at its worker's death), nothing is lost, and keys ran side
    by side, not one by one: the handlers' time adds up to twice the run's span or more (jobs one
    by one: below 1 whatever the machine's load), and 4 keys or more ran at one moment."""
    sup = supervisor_factory(nats_server, workers={"count": 3, "concurrency": 2, "handler": HANDLER}, ordering=ORDERED)
    sup.wait_ready()
    rng = random.Random(27)
    jobs = keyed_jobs(rng, 1000, 20, 0.03)
    seqs = publish_keyed(nats_server.url, jobs)
    key_of = {s: subject for s, (subject, _) in zip(seqs, jobs)}
    died: dict[int, float] = {}
    for share in (0.25, 0.5, 0.75):
        wait_until(lambda: len(done(sup) & set(seqs)) >= share * len(seqs), what=f"{share:.0%} of the jobs done")
        wait_until(lambda: kill_a_running_worker(sup, rng, died), what="a worker running a job, to kill")
    wait_until(lambda: set(seqs) <= done(sup), timeout=120, what="every job done")
    runs = runs_of(sup)
    assert_in_order(runs, key_of, died)
    assert len(died) == 3 and any(r.end is None and r.pid in died for r in runs), "no kill caught a job running"
    together, keys_at_once = overlap(runs), most_keys_at_once(runs, key_of)
    print(f"jobs ran {together:.2f} at a time on average, up to {keys_at_once} keys at once")
    assert together >= 2.0 and keys_at_once >= 4, \
        f"jobs ran {together:.2f} at a time on average, {keys_at_once} keys at most: keys did not run in parallel"
    status = sup.status()["ordering"]
    assert status["key"] == "subject:2" and status["checks"] >= len(seqs) and status["parked"] == 0


def test_two_supervisors_one_killed_keep_every_key_in_order(nats_server, supervisor_factory):
    """Two supervisors on one stream (2 workers each), 800 jobs over 16 keys; one supervisor's whole
    process group SIGKILLed mid-run. Its jobs come back after AckWait (3 s) and their keys wait
    for them; the other keys go on; every key stays in order and nothing is lost."""
    common = {"workers": {"count": 2, "concurrency": 2, "handler": HANDLER}, "ordering": ORDERED,
              "consumer": {"ack_wait": 3.0}}
    a, b = (supervisor_factory(nats_server, **common) for _ in range(2))
    a.wait_ready()
    b.wait_ready()
    rng = random.Random(2)
    jobs = keyed_jobs(rng, 800, 16, 0.008)
    seqs = publish_keyed(nats_server.url, jobs)
    key_of = {s: subject for s, (subject, _) in zip(seqs, jobs)}
    victims = b.worker_pids()         # read first: between the journal's word and the kill, 0-8 ms jobs end
    wait_until(lambda: len(done(b) & set(seqs)) >= 100 and b.jobs.running(), what="B running jobs")
    os.killpg(b.proc.pid, signal.SIGKILL)
    t = time.time()
    b.proc.wait()
    died = dict.fromkeys(victims, t)
    wait_until(lambda: set(seqs) <= done(a, b), timeout=90, what="every job done by A")
    runs = runs_of(a, b)
    assert_in_order(runs, key_of, died)
    # What B held at the kill, a job running or parked for its key's turn (4 per handler ahead of
    # hundreds waiting), came back after AckWait and ran on A. A job seen running may have ended
    # just before the kill: either shows the kill took jobs away.
    caught = [r for r in runs if r.end is None and r.pid in victims]
    back = [r for r in runs if r.pid not in victims and r.delivery > 1 and r.start > t]
    assert caught or back, "the kill took no job away from B"
    assert {r.pid for r in runs} & victims and {r.pid for r in runs} - victims, "one supervisor ran everything"


# ---------------------------------------------------------------- a poison job holds back its key only

def test_a_poison_job_holds_back_its_key_until_it_is_dead_lettered_and_no_other(nats_server, supervisor_factory):
    """Key kP's first job kills its worker 1.5 s into every delivery: quarantined after 3 deaths
    (dead-lettered and TERMed: it leaves the stream), and only then do kP's next jobs run, in
    order. The 8 other keys' 240 jobs do not wait for it: every one of those keys runs jobs
    while it comes and goes (4.5 s at least), two dozen of them or more in all."""
    sup = supervisor_factory(nats_server, workers={"count": 3, "handler": HANDLER}, ordering=ORDERED,
                             restart={"poison_after_crashes": 3, "backoff_initial": 0.05, "backoff_max": 0.2},
                             args=("--log-format", "json"))
    sup.wait_ready()
    rng = random.Random(3)
    # 1.5 s a life: on a loaded box the other workers' first seconds (start-up, each key's first
    # question to the stream) must not use up the window in which the keys are watched.
    jobs = [("jobs.kP", "crash-after:1.5"), *(("jobs.kP", "0.01") for _ in range(3))]
    others = keyed_jobs(rng, 240, 8, 0.02)
    seqs = publish_keyed(nats_server.url, jobs + others)
    key_of = {s: subject for s, (subject, _) in zip(seqs, jobs + others)}
    poison, after, rest = seqs[0], seqs[1:4], set(seqs[4:])
    wait_until(lambda: set(seqs[1:]) <= done(sup), timeout=90, what="every job but the poison done")
    dead_lettered = sup.wait_event("dead_letter", seq=poison)["ts"] - 0.001
    runs = runs_of(sup)
    poison_runs = [r for r in runs if r.seq == poison]
    assert len(poison_runs) == 3 and all(r.end is None for r in poison_runs), poison_runs
    died = {r.pid: r.start + 1.5 for r in poison_runs}
    assert_in_order([r for r in runs if r.seq != poison], key_of, died)
    assert min(r.start for r in runs if r.seq in after) > dead_lettered, "kP went on before its poison was dealt with"
    first = min(r.start for r in poison_runs)
    meanwhile = [r for r in runs if r.seq in rest and first < r.start < dead_lettered]
    assert {key_of[r.seq] for r in meanwhile} == {key_of[q] for q in rest}, "a key waited for another key's poison"
    assert len(meanwhile) >= 24, f"only {len(meanwhile)} jobs of other keys started while the poison came and went"
    assert any(h.get("Supervisor-Dead-Letter-Sequence") == str(poison) for h in dead_letter_headers(nats_server.url))


def test_a_long_job_of_one_key_holds_up_no_other_key(nats_server, supervisor_factory, tmp_path):
    """Key kA's job runs until the test says; six jobs of six other keys, published meanwhile, all
    run on the other worker without waiting for it. A worker whose only handler is busy asks for
    nothing: a job of another key, free to start, pulled then, would wait behind kA's job while
    the other worker sat idle (3 of 6 did, before: the room beyond the handlers was a look ahead
    any job could fill)."""
    gate = tmp_path / "gate"
    sup = supervisor_factory(nats_server, workers={"count": 2, "handler": HANDLER}, ordering=ORDERED)
    sup.wait_ready(2)
    [long_job] = publish_keyed(nats_server.url, [("jobs.kA", f"until:{gate}")])
    wait_until(lambda: any(r.seq == long_job for r in sup.jobs.running()), what="kA's job running")
    try:
        others = set(publish_keyed(nats_server.url, [(f"jobs.kB{i}", "0") for i in range(6)]))
        wait_until(lambda: others <= done(sup), timeout=30, what="the other keys' jobs done while kA's runs")
        assert long_job not in done(sup)
    finally:
        gate.touch()
    wait_until(lambda: long_job in done(sup), what="kA's job done")


def test_a_held_key_whose_jobs_fill_max_ack_pending_holds_back_every_other_key(nats_server, supervisor_factory,
                                                                                tmp_path):
    """The limit README "Ordered per key" states: a key held back holds back no other key only
    while its waiting jobs stay below consumer.max_ack_pending. kA's first job runs until the
    test says, max_ack_pending = 6: kA's next jobs are delivered and parked until the consumer
    has 6 out, and kB's job, stored behind them, is not delivered (nothing can be acked: every
    job out waits for kA's first) until kA's first ends. Then all run, in order."""
    gate = tmp_path / "gate"
    sup = supervisor_factory(nats_server, workers={"count": 2, "handler": HANDLER}, ordering=ORDERED,
                             consumer={"max_ack_pending": 6})
    sup.wait_ready(2)
    jobs = [("jobs.kA", f"until:{gate}"), *(("jobs.kA", "0") for _ in range(8)), ("jobs.kB", "0")]
    seqs = publish_keyed(nats_server.url, jobs)
    try:
        wait_until(lambda: nats_server.consumer()["num_ack_pending"] == 6 and sup.status()["ordering"]["parked"] == 5,
                   what="the consumer full: kA's first running, 5 of its jobs parked")
        consumer = nats_server.consumer()
        assert consumer["num_pending"] == 4 and seqs[-1] not in {r.seq for r in sup.jobs.started()}, consumer
    finally:
        gate.touch()
    wait_until(lambda: set(seqs) <= done(sup), what="every job done once kA's first ended")
    runs = runs_of(sup)
    assert_in_order(runs, {s: subject for s, (subject, _) in zip(seqs, jobs)})
    [held], [kb] = ([r for r in runs if r.seq == seq] for seq in (seqs[0], seqs[-1]))
    assert held.end is not None and kb.start > held.end, "kB's job did not wait for kA's first"


def test_a_retiring_worker_gives_back_at_once_what_waits_for_its_keys_turn(nats_server, supervisor_factory, tmp_path):
    """F16 (seed 702): a retiring worker (recycled: max_jobs, max_rss_mb, a reload; here its
    SIGUSR1) let a job parked for its key's turn wait within graceful_timeout, and start when the
    turn came, however little grace was left: NAKed still running when the grace ran out, its
    redelivery ran beside it. Now it gives parked jobs back at once: the worker holding kA's second
    job, parked behind kA's first (running elsewhere until the test says), retires and exits long
    before its 60 s grace, and the job runs once, after the first, on another worker."""
    gate = tmp_path / "gate"
    sup = supervisor_factory(nats_server, workers={"count": 2, "handler": HANDLER, "graceful_timeout": 60.0},
                             ordering=ORDERED, args=("--log-format", "json"))
    sup.wait_ready(2)
    first, second = publish_keyed(nats_server.url, [("jobs.kA", f"until:{gate}"), ("jobs.kA", "0")])
    wait_until(lambda: any(r.seq == first for r in sup.jobs.running()), what="kA's first job running")

    def holder() -> int | None:
        return next((w["pid"] for w in sup.status()["workers"]["list"] if w["parked"]), None)   # the one parked
    pid = wait_until(holder, what="kA's second job parked in a worker")
    runner = next(r.pid for r in sup.jobs.running() if r.seq == first)
    assert pid != runner, "both in one worker: nothing to force"     # one handler each: it must be the other
    os.kill(pid, signal.SIGUSR1)
    try:
        wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                   timeout=20, what="the retiring worker gone, its parked job given back")
        assert second not in done(sup) and not sup.events("graceful_timeout_nak")
    finally:
        gate.touch()
    wait_until(lambda: {first, second} <= done(sup), what="both jobs done")
    runs = runs_of(sup)
    assert [r.seq for r in sorted(runs, key=lambda r: r.start)] == [first, second], runs
    assert sup.stop() == 0


# ---------------------------------------------------------------- beside recycling, drains, retries, the guard

def test_order_beside_recycling_a_drain_a_long_retry_and_the_guard(nats_server, supervisor_factory):
    """max_jobs = 5 (workers recycled all along), [idempotency] on, one job of key kR asks for a
    0.4 s retry (above retry.republish_after = 0.1: unordered, it would be re-published as a new,
    later message), and the supervisor drained (SIGTERM) mid-run and started again. Every key in
    order, nothing lost, and the retried job ran again as delivery 2 of its own sequence (a NAK
    its key waited for, never a copy)."""
    config = {"workers": {"count": 3, "concurrency": 2, "max_jobs": 5, "handler": HANDLER}, "ordering": ORDERED,
              "idempotency": {"enabled": True}, "retry": {"republish_after": 0.1}}
    sup = supervisor_factory(nats_server, **config)
    sup.wait_ready()
    rng = random.Random(4)
    jobs = keyed_jobs(rng, 150, 10, 0.01)
    jobs[20] = ("jobs.kR", "retry:0.4")
    jobs += [("jobs.kR", "0.001") for _ in range(5)]
    seqs = publish_keyed(nats_server.url, jobs)
    key_of = {s: subject for s, (subject, _) in zip(seqs, jobs)}
    wait_until(lambda: len(done(sup) & set(seqs)) >= 60, what="60 jobs done")
    sup.signal(signal.SIGTERM)
    assert sup.wait(timeout=15) == 0, "the drain took graceful_timeout: a job it had in hand waited for it"
    sup.start()
    wait_until(lambda: set(seqs) <= done(sup), timeout=90, what="every job done after the restart")
    runs = runs_of(sup)
    assert_in_order(runs, key_of)
    retried = sorted((r.delivery, r.start) for r in runs if r.seq == seqs[20])
    assert len(retried) == 2 and retried[0][0] == 1, f"the retried job ran as deliveries {retried}"   # the
    # second may be delivery 3: a drain NAKs a job it had not started yet (delivery 2, parked or queued)
    kr_after = [r.start for r in runs if r.seq in seqs[-5:]]
    assert min(kr_after) > retried[1][1]
    assert len({r.pid for r in runs}) > 6, "workers were not recycled"


# ---------------------------------------------------------------- through scaling, a reload and recycling

class KeyedFeed:
    """Keyed jobs published as the workers take them: whenever the stream stores fewer than
    `low`, `low` more (`keyed_jobs`). The load then lasts as long as what the test does beside
    it takes, on a quiet box or a loaded one, with no sleep guessing how long that is."""

    def __init__(self, server, rng: random.Random, keys: int, longest: float, low: int = 96, most: int = 5000):
        self.server, self.rng, self.keys, self.longest, self.low, self.most = server, rng, keys, longest, low, most
        self.key_of: dict[int, str] = {}
        self.stored_at: dict[str, int] = {}       # what the stream stored when each step was seen done

    def top_up(self) -> None:
        if self.server.stream_msgs() < self.low:
            assert len(self.key_of) < self.most, f"{len(self.key_of)} jobs published and the test's steps not done"
            jobs = keyed_jobs(self.rng, self.low, self.keys, self.longest)
            self.key_of.update(zip(publish_keyed(self.server.url, jobs), (subject for subject, _ in jobs)))

    def wait(self, predicate: Callable[[], Any], what: str) -> Any:
        """wait_until(predicate), topping the stream up meanwhile; then note what it stored."""
        def topped_up() -> Any:
            self.top_up()
            return predicate()
        value = wait_until(topped_up, what=what)
        self.stored_at[what] = self.server.stream_msgs()
        return value


def test_keys_keep_their_order_through_scaling_a_reload_and_recycling(nats_server, supervisor_factory, tmp_path):
    """An ordered load over 12 keys (jobs of 0-30 ms, topped up as they are taken) on 2 workers of
    2 handlers, recycled every 50-60 jobs (max_jobs); meanwhile `supervisor scale 4` (its new
    workers seen running jobs), POST /scale?workers=2 (the two retired, gone), a recycle seen,
    then a SIGHUP that sets workers.concurrency = 1 and max_jobs = 0 (both read at fork: every
    worker is replaced, the replacement first) while an old worker runs kL's first job until the
    test says: it retires holding it while the new workers run jobs, and kL's next job waits for
    it. Each step is seen done while jobs are still stored. From the journal: per key no job
    started before the previous one of its key ended (kL's next after its first), every job ran
    once and is done, and the reload's workers ran one job at a time (they took the new
    config)."""
    gate = tmp_path / "gate"
    workers = {"count": 2, "concurrency": 2, "max_jobs": 50, "max_jobs_jitter": 10, "handler": HANDLER}
    sup = supervisor_factory(nats_server, workers=workers, ordering=ORDERED, args=("--log-format", "json"))
    sup.wait_ready()
    feed = KeyedFeed(nats_server, random.Random(34), keys=12, longest=0.03)
    feed.wait(lambda: len(done(sup)) >= 60, what="the load flowing")

    def first_in_slots(*slots: int) -> dict[int, int]:
        """slot -> the first worker ready in it."""
        first: dict[int, int] = {}
        for e in sup.events("worker_ready"):
            if e["slot"] in slots:
                first.setdefault(e["slot"], e["worker_pid"])
        return first

    def ran_jobs(pids) -> bool:
        started = {r.pid for r in sup.jobs.started()}
        return bool(pids) and all(pid in started for pid in pids)

    r = run_cli("scale", "4", "--url", sup.http)
    assert r.returncode == 0, r.stdout + r.stderr
    feed.wait(lambda: len(added := first_in_slots(2, 3)) == 2 and ran_jobs(added.values()),
              what="scaled up to 4, the new workers running jobs")
    request = urllib.request.Request(f"http://{sup.http}/scale?workers=2", method="POST")
    with urllib.request.urlopen(request, timeout=5) as answer:
        assert answer.status == 202
    feed.wait(lambda: len(retired := sup.events("worker_retiring", reason="scaled down")) == 2
              and not {e["worker_pid"] for e in retired} & sup.worker_pids(), what="scaled down to 2")
    feed.wait(lambda: any("max_jobs" in e["reason"] for e in sup.events("worker_recycling")),
              what="a worker recycled (max_jobs)")
    # kL's first job runs in a worker forked before the reload until the test says: that worker
    # retires holding it while the new workers run jobs, and kL's next job waits for it.
    held = publish_keyed(nats_server.url, [("jobs.kL", f"until:{gate}"), ("jobs.kL", "0")])
    feed.key_of.update(dict.fromkeys(held, "jobs.kL"))
    holder = feed.wait(lambda: next((r.pid for r in sup.jobs.running() if r.seq == held[0]), None),
                       what="kL's first job running")
    sup.config_path.write_text(tomli_w.dumps({**sup.config, "workers": {**workers, "concurrency": 1,
                                                                        "max_jobs": 0}}))
    sup.signal(signal.SIGHUP)
    reloaded = feed.wait(lambda: sup.events("reload_applied", key="workers.concurrency"), what="the reload")[0]["ts"]

    def forked_after_the_reload() -> list[dict]:
        asked = time.time()
        serving = [w for w in sup.status()["workers"]["list"] if not w["retiring"]]
        return serving if len(serving) == 2 and all(w["state"] == "ready" and w["uptime_s"] < asked - reloaded
                                                    for w in serving) else []
    reborn = {w["pid"] for w in feed.wait(forked_after_the_reload, what="every worker replaced by the reload")}
    try:
        feed.wait(lambda: ran_jobs(reborn), what="the reload's workers running jobs")
        assert holder in sup.worker_pids() and held[0] not in done(sup), "kL's first job did not wait for the test"
    finally:
        gate.touch()
    seqs, key_of = set(feed.key_of), feed.key_of
    wait_until(lambda: seqs <= done(sup), timeout=120, what="every job done")

    runs = runs_of(sup)
    print(f"{len(seqs)} jobs on {len({r.pid for r in runs})} workers; stored when each step was seen done: "
          f"{feed.stored_at}; recycled {len(sup.events('worker_recycling'))} times")
    assert_in_order(runs, key_of)
    assert sorted(r.seq for r in runs) == sorted(seqs), "a job ran twice, or never: no fault here explains it"
    assert all(r.end is not None for r in runs), "a run never ended"
    assert all(stored > 0 for stored in feed.stored_at.values()), f"a step was done after the load: {feed.stored_at}"
    scaling = [(e["from"], e["to"], e["source"]) for e in sup.events("scaling")]
    assert [(a, b) for a, b, _ in scaling] == [(2, 4), (4, 2)], scaling
    # The steps were taken under the load: the workers scaled up ran jobs (waited for above), so
    # did the ones scaled down; the reload's workers (forked after it) ran one job at a time, and
    # ran jobs while an old one still ran kL's first (waited for above).
    runs_by: dict[int, list[Run]] = {}
    for r in runs:
        runs_by.setdefault(r.pid, []).append(r)
    retired = {e["worker_pid"] for e in sup.events("worker_retiring", reason="scaled down")}
    assert any(pid in runs_by for pid in retired), "the workers scaled down had run no job"
    for pid in reborn:
        mine = sorted(runs_by[pid], key=lambda r: r.start)
        assert all(b.start >= a.end for a, b in zip(mine, mine[1:])), f"worker {pid} ran 2 jobs at once after the reload"
    # kL's next job may run on a new worker, or on an old one that had started its max_jobs-th job
    # before: such a worker keeps its parked jobs until they run (retired, it would give them back,
    # each NAK a delivery spent), here after its replacement was ready. Either way after the first.
    [first] = [r for r in runs if r.seq == held[0]]
    assert first.pid == holder not in reborn, (first, reborn)


# ---------------------------------------------------------------- beside a pool that is not ordered

def test_one_pool_ordered_beside_one_that_is_not_and_a_reload_that_orders_it(nats_server, supervisor_factory):
    """[ordering] key = "subject:3" for every pool; pool b says `ordering_key = ""`. Both take jobs
    keyed by their third token, on their own consumers. Pool a's keys stay in order; pool b's one
    key runs its 0.3 s jobs side by side (it is not ordered, though its subjects have the token);
    /status orders a alone (`pools.NAME.ordering`, the top level a's, the first pool's), /metrics
    labels the series `pool="a"` and has none for b. A SIGHUP that drops b's override replaces
    b's workers, and b's next jobs run one by one, in order."""
    pools = {"a": {"count": 2, "concurrency": 2, "filter_subject": "jobs.a.>"},
             "b": {"count": 2, "concurrency": 2, "filter_subject": "jobs.b.>", "ordering_key": ""}}
    sup = supervisor_factory(nats_server, workers={"handler": HANDLER}, ordering={"key": "subject:3"}, pools=pools)
    sup.wait_ready(4)
    rng = random.Random(28)
    a_jobs = keyed_jobs(rng, 80, 4, 0.02, prefix="a.k")
    b_jobs = [("jobs.b.k0", "0.3")] * 8
    seqs = publish_keyed(nats_server.url, a_jobs + b_jobs)
    key_of = {s: subject for s, (subject, _) in zip(seqs, a_jobs + b_jobs)}
    a_seqs, b_seqs = set(seqs[:len(a_jobs)]), set(seqs[len(a_jobs):])
    wait_until(lambda: set(seqs) <= done(sup), what="both pools' jobs done")
    status = sup.status()
    owner = {w["pid"]: name for name, p in status["pools"].items() for w in p["workers"]["list"]}
    runs = runs_of(sup)
    assert {owner.get(r.pid) for r in runs if r.seq in a_seqs} == {"a"} and \
        {owner.get(r.pid) for r in runs if r.seq in b_seqs} == {"b"}
    assert_in_order([r for r in runs if r.seq in a_seqs], key_of)
    assert reorders([r for r in runs if r.seq in b_seqs], key_of), "pool b's jobs ran one by one: it was ordered"
    assert status["pools"]["a"]["ordering"]["key"] == "subject:3" and status["pools"]["b"]["ordering"] is None
    assert status["ordering"] == status["pools"]["a"]["ordering"]
    assert status["pools"]["a"]["ordering"]["checks"] >= len(a_seqs)
    _, metrics = sup.get("/metrics")
    assert 'jetstream_supervisor_ordering_checks_total{pool="a"}' in metrics and \
        'ordering_parked{pool="b"}' not in metrics, metrics
    # b's override dropped: b inherits [ordering] and its workers are replaced (read at fork)
    old_b = {pid for pid, name in owner.items() if name == "b"}
    inherits = {k: v for k, v in pools["b"].items() if k != "ordering_key"}
    sup.config_path.write_text(tomli_w.dumps({**sup.config, "pools": {**pools, "b": inherits}}))
    sup.signal(signal.SIGHUP)
    wait_until(lambda: (sup.status()["pools"]["b"]["ordering"] or {}).get("key") == "subject:3", what="b ordered")
    wait_until(lambda: not old_b & sup.worker_pids() and len(sup.status()["pools"]["b"]["workers"]["list"]) == 2
               and all(w["state"] == "ready" for w in sup.status()["pools"]["b"]["workers"]["list"]),
               what="b's workers replaced")
    later = publish_keyed(nats_server.url, [("jobs.b.k0", "0.1")] * 6)
    key_of.update(dict.fromkeys(later, "jobs.b.k0"))
    wait_until(lambda: set(later) <= done(sup), what="b's later jobs done")
    assert_in_order([r for r in runs_of(sup) if r.seq in later], key_of)


# ---------------------------------------------------------------- what it refuses

def test_ordering_refuses_a_stream_that_is_not_a_work_queue(nats_server, tmp_path):
    """A stream that keeps what was acked (retention limits) would hold every key back for good:
    exit 2 at start, naming ordering.key and why; with pools, for the pool that is ordered."""
    async def make() -> None:
        nc = await nats.connect(nats_server.url)
        await nc.jetstream().add_stream(name="JOBS", subjects=["jobs.>"], retention="limits")
        await nc.close()
    asyncio.run(make())
    config = tmp_path / "config.toml"
    config.write_text(f'[nats]\nservers = ["{nats_server.url}"]\n[workers]\nhandler = "testhandlers:record"\n'
                      '[monitor]\nhttp = ""\n[ordering]\nkey = "subject:2"\n')
    r = run_cli("start", "--config", str(config), tmp=tmp_path, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "ordering.key" in r.stderr and "not a work queue" in r.stderr, r.stderr
    # with pools, each ordered pool's consumer is checked: b, the second pool, ordered alone
    config.write_text(f'[nats]\nservers = ["{nats_server.url}"]\n[workers]\nhandler = "testhandlers:record"\n'
                      '[monitor]\nhttp = ""\n[pools.a]\nfilter_subject = "jobs.a"\n'
                      '[pools.b]\nfilter_subject = "jobs.b.>"\nordering_key = "subject:3"\n')
    r = run_cli("start", "--config", str(config), tmp=tmp_path, timeout=60)
    assert r.returncode == 2 and "not a work queue" in r.stderr and "consumer workers-b" in r.stderr, r.stderr


def test_ordering_refuses_a_work_queue_that_drops_or_keeps_jobs_by_itself(nats_server, tmp_path):
    """The rule's premise is that a job stays stored until acked or TERMed. A work queue made by
    hand with max_msgs_per_subject = 2 drops a key's running job when its third one is published
    (its second then started beside it: seen on the stream of this test before the check), and
    one that denies deletes keeps a job the consumer gave up on, so its key waited for good (the
    parent's delete refused every minute). Both: exit 2 at start, naming ordering.key and the
    setting. Discard "new" alone still drops the oldest of the subject (nats-server 2.15.1: the
    third publish stored, the first gone); discard "new" per subject refuses the third publish
    instead, so that limit is refused no more."""
    def stream(update: bool = False, **settings) -> None:
        async def run() -> None:
            nc = await nats.connect(nats_server.url)
            js = nc.jetstream()
            config = StreamConfig(name="JOBS", subjects=["jobs.>"], retention=RetentionPolicy.WORK_QUEUE, **settings)
            await (js.update_stream(config) if update else js.add_stream(config))
            await nc.close()
        asyncio.run(run())
    config = tmp_path / "config.toml"
    config.write_text(f'[nats]\nservers = ["{nats_server.url}"]\n[workers]\nhandler = "testhandlers:record"\n'
                      '[monitor]\nhttp = ""\n[ordering]\nkey = "subject:2"\n')
    stream(max_msgs_per_subject=2)
    r = run_cli("start", "--config", str(config), tmp=tmp_path, timeout=60)
    assert r.returncode == 2 and "ordering.key" in r.stderr and "2 job(s) per subject" in r.stderr, r.stdout + r.stderr
    stream(update=True, max_msgs_per_subject=2, discard=DiscardPolicy.NEW)
    r = run_cli("start", "--config", str(config), tmp=tmp_path, timeout=60)
    assert r.returncode == 2 and "2 job(s) per subject" in r.stderr, r.stdout + r.stderr
    stream(update=True, max_msgs_per_subject=2, discard=DiscardPolicy.NEW, discard_new_per_subject=True, deny_delete=True)
    r = run_cli("start", "--config", str(config), tmp=tmp_path, timeout=60)
    assert r.returncode == 2 and "denies deletes" in r.stderr and "per subject" not in r.stderr, r.stdout + r.stderr


def ka_parked_behind_a_gate(nats_server, supervisor_factory, gate) -> tuple:
    """A job of kA runs until `gate` exists; kA's next two jobs wait for it, parked, and kB's job
    is done past them. The supervisor, the sequences, and /status `ordering` once it shows kA
    blocked with a backlog."""
    sup = supervisor_factory(nats_server, workers={"count": 2}, ordering=ORDERED)
    sup.wait_ready()
    seqs = publish_keyed(nats_server.url, [("jobs.kA", f"until:{gate}"), ("jobs.kA", "0"), ("jobs.kA", "0"),
                                           ("jobs.kB", "0")])
    wait_until(lambda: seqs[3] in sup.jobs.done_seqs(), what="kB's job done past kA's")

    def blocked():
        block = sup.status()["ordering"]
        return block if block["blocked"] and block["backlog"]["keys"] else None
    return sup, seqs, wait_until(blocked, what="kA's jobs shown waiting, with a backlog count")


def test_the_status_names_the_key_a_job_waits_for(nats_server, supervisor_factory, tmp_path):
    """A job of kA runs until the test says; the next jobs of kA wait, parked: /status `ordering`
    shows them under `blocked` with the running job as the head they wait for, and the key's
    jobs in the stream under `backlog`; /metrics has the gauges, `supervisor status` a line."""
    gate = tmp_path / "gate"
    sup, seqs, block = ka_parked_behind_a_gate(nats_server, supervisor_factory, gate)
    assert block["blocked"][0]["key"] == "kA" and block["blocked"][0]["head_seq"] == seqs[0]
    assert block["parked"] == block["blocked"][0]["waiting"] == 2 and block["waiting_keys"] == 1
    assert block["backlog"]["top"][0] == {"key": "kA", "jobs": 3}
    _, metrics = sup.get("/metrics")
    assert "jetstream_supervisor_ordering_parked 2.0" in metrics, metrics
    printed = run_cli("status", "--url", f"http://{sup.http}").stdout
    assert f"2 job(s) parked on 1 key(s); longest: key kA behind seq {seqs[0]}" in printed, printed
    gate.touch()
    wait_until(lambda: set(seqs) <= sup.jobs.done_seqs(), what="kA's jobs done")
    assert json.loads(sup.get("/status")[1])["ordering"]["parked"] == 0


def test_the_dashboard_draws_the_key_a_job_waits_for_in_chromium(nats_server, supervisor_factory, tmp_path):
    """The same wait, drawn by the dashboard in a real Chromium: kA in the ordering table, its 3
    jobs in the backlog line."""
    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it when it can): "
                    "the ordering block was not rendered in a browser")
    gate = tmp_path / "gate"
    sup, seqs, _ = ka_parked_behind_a_gate(nats_server, supervisor_factory, gate)
    browser = Browser(binary)
    try:
        page = browser.new_page(1000, 1200)
        page.goto(f"http://{sup.http}/")
        page.wait_for("document.querySelector('#ordering-table td') && "
                      "document.querySelector('#ordering-table td').textContent === 'kA'", what="kA drawn")
        assert not page.evaluate("document.getElementById('ordering').hidden")
        assert "kA 3" in page.evaluate("document.getElementById('ordering-backlog').textContent")
    finally:
        browser.close()
        gate.touch()
    wait_until(lambda: set(seqs) <= sup.jobs.done_seqs(), what="kA's jobs done")


# ---------------------------------------------------------------- on a cluster

def test_on_an_r3_stream_order_holds_through_leader_changes(nats_cluster, supervisor_factory):
    """Two supervisors on an R3 stream of a 3-node cluster, 400 jobs over 12 keys, the stream
    leader (which answers the workers' questions and applies an ack's removal last: a raft
    proposal after the consumer's own) and the consumer leader each stepped down mid-run. A new
    leader that has not applied a removal yet only says an earlier job is still stored: every
    key in order, nothing lost."""
    sups = [supervisor_factory(None, nats={"servers": nats_cluster.urls, "startup_timeout": 30.0},
                               stream={"replicas": 3}, consumer={"ack_wait": 10.0}, fleet={"name": name},
                               workers={"count": 2, "handler": HANDLER}, ordering=ORDERED)
            for name in ("alpha", "beta")]
    for s in sups:
        s.wait_ready()
    rng = random.Random(5)
    jobs = keyed_jobs(rng, 400, 12, 0.01)
    seqs = publish_keyed(nats_cluster.urls[0], jobs)
    key_of = {s: subject for s, (subject, _) in zip(seqs, jobs)}
    for share, step in ((0.25, lambda: nats_cluster.stepdown_stream("JOBS")),
                        (0.5, lambda: nats_cluster.stepdown_consumer("JOBS", "workers")),
                        (0.75, lambda: nats_cluster.stepdown_stream("JOBS"))):
        wait_until(lambda: len(done(*sups) & set(seqs)) >= share * len(seqs), what=f"{share:.0%} done")
        assert "error" not in step()
    wait_until(lambda: set(seqs) <= done(*sups), timeout=120, what="every job done")
    assert_in_order(runs_of(*sups), key_of)


# ---------------------------------------------------------------- two deliveries of one job in one worker (F15)

class HeldJob:
    """The test's own client as another worker: it takes the next job from the consumer and keeps
    it alive (+WPI every `ping` seconds) on a thread of its own until `ack()`; the key's later jobs
    wait for it wherever they are parked."""

    def __init__(self, urls: list[str], ping: float):
        self.ping, self.urls = ping, urls
        self.loop = asyncio.new_event_loop()
        self.acked = asyncio.Event()
        self.seq: int | None = None
        self.taken = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._hold(),), daemon=True)
        self.thread.start()
        assert self.taken.wait(30) and self.seq, "the test's client took no job"

    async def _hold(self) -> None:
        nc = await nats.connect(self.urls)
        try:
            sub = await nc.jetstream().pull_subscribe_bind("workers", "JOBS")
            [msg] = await sub.fetch(1, timeout=20)
            self.seq = msg.metadata.sequence.stream
            self.taken.set()
            while not self.acked.is_set():
                await msg.in_progress()
                try:
                    await asyncio.wait_for(self.acked.wait(), self.ping)
                except TimeoutError:
                    pass
            await msg.ack_sync()
        finally:
            self.taken.set()
            await nc.close()

    def ack(self) -> None:
        self.loop.call_soon_threadsafe(self.acked.set)
        self.thread.join(30)
        assert not self.thread.is_alive(), "the held job's ack did not go out"


def test_a_second_delivery_of_a_job_its_worker_just_acked_does_not_start(nats_cluster, supervisor_factory, tmp_path):
    """F15 (seed 604, seq 771). Two deliveries of kA's second job B parked in the one worker: B
    waits behind kA's first job A (held by the test's client) while the parent is SIGSTOPped
    past AckWait (no +WPI), so the server hands B to the worker again. A is acked, one delivery
    of B runs, and the other becomes kA's candidate the moment that one is acked. The server has
    read that ack but not applied it: on an R3 stream the removal is two raft proposals away,
    held here by pausing the two nodes that do not lead the stream (the worker talks to the
    leader alone), so the stream still says B is the first stored job of kA. Before, the START
    rule held and B ran twice (and in about one run of three without the pause). It is acked
    unrun now (ordering_settled_twice), and runs once."""
    ack_wait, gate = 2.0, tmp_path / "gate"
    maker = supervisor_factory(None, nats={"servers": nats_cluster.urls, "startup_timeout": 30.0},
                               stream={"replicas": 3}, consumer={"ack_wait": ack_wait},
                               workers={"count": 1, "handler": HANDLER}, ordering=ORDERED)
    maker.wait_ready()
    assert maker.stop() == 0                     # the stream and the consumer are made: A goes to the test
    leader = nats_cluster.stream_leader("JOBS")
    others = [n for n in nats_cluster.live() if n is not leader]
    [first] = publish_keyed(leader.url, [("jobs.kA", "0")])
    held = HeldJob(nats_cluster.urls, ping=ack_wait / 4)
    assert held.seq == first
    sup = supervisor_factory(None, nats={"servers": [leader.url], "startup_timeout": 30.0},
                             stream={"replicas": 3}, consumer={"ack_wait": ack_wait},
                             workers={"count": 1, "concurrency": 1, "handler": HANDLER}, ordering=ORDERED,
                             args=("--log-format", "json"))
    try:
        sup.wait_ready()
        [second] = publish_keyed(leader.url, [("jobs.kA", f"until:{gate}")])

        def parked() -> int:
            return sum(w["parked"] for w in sup.status()["workers"]["list"])
        wait_until(lambda: parked() == 1, what="B parked behind A")
        delivered = nats_cluster.consumer_state("JOBS", "workers")["delivered"]["consumer_seq"]
        os.kill(sup.proc.pid, signal.SIGSTOP)    # no +WPI for B: AckWait runs out, B comes again
        try:
            wait_until(lambda: nats_cluster.consumer_state("JOBS", "workers")["delivered"]["consumer_seq"] > delivered,
                       timeout=ack_wait * 5, what="B delivered again")
        finally:
            os.kill(sup.proc.pid, signal.SIGCONT)
        wait_until(lambda: parked() == 2, what="both deliveries of B parked in the one worker")
    finally:
        held.ack()

    def b_starts() -> int:
        return sum(r.seq == second for r in sup.jobs.started())
    wait_until(lambda: b_starts() == 1, what="one delivery of B running")
    for n in others:
        n.pause()
    try:
        gate.touch()                             # B's run ends: its ack is read, and cannot be applied
        wait_until(lambda: b_starts() > 1 or sup.events("ordering_settled_twice", seq=second),
                   what="B's other delivery started or acked unrun")
    finally:
        for n in others:
            n.resume()
    wait_until(lambda: nats_cluster.consumer_state("JOBS", "workers")["num_ack_pending"] == 0, what="nothing pending")
    assert b_starts() == 1, sup.jobs.started()
    assert second in done(sup) and nats_cluster.stream_messages("JOBS") == 0
