"""[limits.NAME] and pauses without a server: the KV layout both sides read
(workers/protocol/limitkeys.py), the config's rules, and the views of a literal Snapshot."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_views import snapshot

from supervisor.config import Config, ConfigError
from supervisor.observe import metrics
from supervisor.observe.snapshot import LimitView
from supervisor.observe.status import build_status, health
from workers.protocol.limitkeys import Holder, parse_key, rate_key, rate_window, slot_key


@pytest.mark.parametrize("rate, window", [(10, (10, 1)), (2.5, (5, 2)), (0.1, (1, 10)), (1 / 3, (1, 3)),
                                          (0.5, (1, 2)), (100, (100, 1)), (0.001, (1, 1000)),
                                          (7.123456, (427, 60))])
def test_a_rate_is_a_whole_number_of_starts_in_whole_seconds_never_above_it(rate, window):
    keys, seconds = rate_window(rate)
    assert (keys, seconds) == window
    assert keys / seconds <= rate + 1e-9


def test_keys_and_holders_read_back():
    assert parse_key(slot_key("db-main", 3)) == ("db-main", "c", 3)
    assert parse_key(rate_key("api_1", 0)) == ("api_1", "r", 0)
    assert parse_key("pause.JOBS.workers") is None and parse_key("db.x.1") is None
    h = Holder("host-a", 100, 200, "ab12")
    assert Holder.parse(h.value(job=7)) == h
    assert Holder.parse(b"done seq=3") is None


@pytest.mark.parametrize("limits, key, problem", [
    ({"db": {}}, "limits.db", "needs concurrency or rate"),
    ({"db": {"concurrency": 2, "subjects": ["orders.>"]}}, "limits.db.subjects", "not within stream.subjects"),
    ({"db": {"rate": 1, "subjects": ["jobs..x"]}}, "limits.db.subjects", "not a valid subject"),
])
def test_a_limit_that_could_never_work_is_a_config_error(limits, key, problem):
    with pytest.raises(ConfigError) as err:
        Config().replace(limits=limits)
    assert err.value.key == key and problem in str(err.value)


DB = LimitView(name="db", concurrency=3, rate=0.0, subjects=("jobs.db.>",), in_use=3, starts=0, waiting=4,
               held_here=2, taken=120, wait_s=33.25)
API = LimitView(name="api", concurrency=0, rate=2.5, subjects=(), in_use=None, starts=None, waiting=0,
                held_here=0, taken=0, wait_s=0.0)


def test_status_shows_each_limit_and_the_pause():
    snap = snapshot(limits=(DB, API))
    s = build_status(snap)
    assert s["limits"]["db"] == {"concurrency": 3, "in_use": 3, "rate": 0.0, "waiting": 4, "starts": 0,
                                 "rate_window": None, "held_here": 2, "taken": 120, "wait_s": 33.25,
                                 "subjects": ["jobs.db.>"]}
    assert s["limits"]["api"]["rate_window"] == {"starts": 5, "seconds": 2} and s["limits"]["api"]["in_use"] is None
    assert s["paused_until"] is None and s["pause_reason"] is None
    values = {**snap.consumer.values, "paused_until": "2030-01-01T00:00:00Z", "pause_reason": "db down"}
    paused = snapshot(consumer=dataclasses.replace(snap.consumer, values=values))
    s = build_status(paused)
    assert (s["paused_until"], s["pause_reason"]) == ("2030-01-01T00:00:00Z", "db down")
    assert s["headline"]["state"] == "paused" and "db down" in s["headline"]["reason"]
    assert health(paused) == (True, "ok")


def test_an_unreadable_limits_bucket_is_an_alert():
    kinds = [a["kind"] for a in build_status(snapshot(limits=(DB,), limits_error="limits bucket X: timeout"))["alerts"]]
    assert "limits_unavailable" in kinds


def test_metrics_of_limits():
    text = metrics.render(snapshot(limits=(DB, API))).decode()
    found = {(s.name, s.labels.get("limit")): s.value for fam in text_string_to_metric_families(text)
             for s in fam.samples}
    p = "jetstream_supervisor_"
    assert found[(p + "limit_in_use", "db")] == 3 and (p + "limit_in_use", "api") not in found
    assert found[(p + "limit_waiting", "db")] == 4
    assert found[(p + "limit_wait_seconds_total", "db")] == 33.25
    assert found[(p + "limit_taken_total", "db")] == 120
    assert found[(p + "consumer_paused", None)] == 0


class FakeBucket:
    """The Limiter's bucket calls, in memory: create-if-absent; which keys were asked, released,
    and how often this worker said it waits."""

    def __init__(self, taken: set[str] = frozenset()):
        self.keys, self.asked, self.released, self.wants = set(taken), [], [], 0
        self.table, self.closing = None, False

    async def create(self, key: str, ttl: int) -> int:
        from workers.middleware.guard import Conflict
        self.asked.append(key)
        if key in self.keys:
            raise Conflict(key)
        self.keys.add(key)
        return len(self.asked)

    async def release(self, name: str, k: int, revision: int) -> None:
        self.released.append(slot_key(name, k))
        self.keys.discard(slot_key(name, k))

    def spawn(self, coro) -> None:
        import asyncio
        asyncio.ensure_future(coro)

    def want(self, name: str) -> None:
        self.wants += 1

    def admit(self) -> None:
        """Before each take: a worker's parked jobs without a handler withdraw (none here)."""

    def timed(self, seconds: float) -> None:
        """A take's round trip (the worker's look-ahead): not measured here."""


def test_a_take_looks_again_while_the_limit_had_room_and_waits_once_it_is_full():
    """With room to spare, each take finds a slot itself (before: only the first did; the next
    waited for the last holder's release word). Once a look finds every slot it tried taken, a
    take tries only the slots a word named, until a poll is due."""
    import asyncio

    from workers.middleware.limits import Gate

    async def take(gate) -> int | None:
        await gate.take_slots(1)
        return gate.spares.pop() if gate.spares else None

    async def run() -> None:
        roomy = FakeBucket()
        gate = Gate(roomy, 0, "db", concurrency=1000, rate=0.0)     # type: ignore[arg-type]
        assert [await take(gate) is not None for _ in range(5)] == [True] * 5

        full = FakeBucket({slot_key("db", k) for k in range(3)})
        gate = Gate(full, 0, "db", concurrency=3, rate=0.0)        # type: ignore[arg-type]
        assert await take(gate) is None and len(full.asked) == 3
        assert await take(gate) is None and len(full.asked) == 3, "looked again while full, no word"
        full.keys.discard(slot_key("db", 1))
        gate.on_freed(1)
        assert await take(gate) == 1 and full.asked[-1] == slot_key("db", 1)
    asyncio.run(run())


@pytest.mark.parametrize("deliveries", [(1, 2), (1, 1)], ids=["redelivered", "delivery-1-again"])
def test_a_job_redelivered_to_the_worker_that_parks_it_gives_back_both_deliveries_grants(deliveries):
    """A job parked past AckWait (the parent's +WPI stalled) can come back, to the same worker,
    while its first delivery still waits; at delivery 1 again when the server lost the consumer's
    state meanwhile (a server SIGKILLed, a consumer deleted and made again). Both deliveries are
    the job's (at least once: the server's loss explains the rerun), so each is parked, admitted
    and settled with its own grants. Before (keys by seq and delivery): the second overwrote the
    first's entry, one set of grants was never given back (a slot held and renewed until the
    worker exits), and with equal keys the second delivery was never admitted at all (held,
    kept alive by +WPI, never run)."""
    import asyncio

    from workers import Job
    from workers.middleware.limits import Grant, Limits

    class FakeGate:                       # one slot, free when the test says
        index = 0

        def __init__(self) -> None:
            self.free = asyncio.Event()
            self.held: list[Grant] = []

        def known_full(self) -> bool:
            return False

        def take_now(self) -> None:
            return None

        async def take(self, waiting=None, counted=True) -> Grant:
            if waiting is not None and not self.free.is_set():
                waiting()
            await self.free.wait()
            grant = Grant(self, 0)        # type: ignore[arg-type]
            self.held.append(grant)
            return grant

        def give_back(self, grant: Grant) -> None:
            self.held.remove(grant)

    async def run() -> None:
        limits = Limits(Config().replace(limits={"db": {"concurrency": 1, "subjects": ["jobs.db.>"]}},
                                         workers={"concurrency": 2}))      # a handler free for each
        gate = FakeGate()
        limits.limiter = type("FakeLimiter", (), {"gate": lambda self, name: gate})()   # type: ignore[assignment]
        first, second = (Job(b"x", "jobs.db.w", stream_seq=7, delivery=d) for d in deliveries)
        admitted: list[Job] = []
        limits.park(first, first, admitted.append)
        limits.park(second, second, admitted.append)
        await asyncio.sleep(0)
        assert len(limits.parked) == len(limits.parked.waiting) == 2      # both parked, both waiting
        gate.free.set()
        for _ in range(100):
            await asyncio.sleep(0)
        assert admitted == [first, second] and admitted[0] is first and admitted[1] is second
        assert len(gate.held) == 2
        for job in admitted:
            await limits.before_job(job)                               # taken already: nothing more
            await limits.after_job(job, "ack", None)
        assert gate.held == [] and not limits.parked and not limits.granted
    asyncio.run(run())


def test_a_slot_passes_from_job_to_job_in_a_worker_until_someone_elsewhere_wants_it(monkeypatch):
    """A roomy concurrency limit: a slot given back goes to the next job waiting here, or lingers
    as a spare the next job takes at once, with no request (the per-job cost measured by
    `python -m bench --only limits`); a spare nobody takes goes back after LINGER. Once a worker
    elsewhere says it waits (`wanted`), spares go back at once and every slot goes back to the
    fleet when its job ends; past KEEP_FOR too. A limit with a rate never keeps a slot."""
    import asyncio

    import workers.middleware.limits as limits_mod
    from workers.middleware.limits import Gate

    monkeypatch.setattr(limits_mod, "LINGER", 0.05)

    async def run() -> None:
        bucket = FakeBucket()
        gate = Gate(bucket, 0, "db", concurrency=100, rate=0.0)   # type: ignore[arg-type]
        first = await gate.take()
        slot, asked = first.slot, len(bucket.asked)
        waiting = asyncio.ensure_future(gate.take())
        await asyncio.sleep(0)
        gate.roomy = False                                        # (no lingering: the hand-over itself)
        gate.give_back(first)                                     # handed over, not released
        second = await waiting
        assert second.slot == slot and not bucket.released
        gate.roomy = True
        gate.give_back(second)                                    # nobody waits: it lingers
        third = gate.take_now()
        assert third is not None and third.slot == slot and len(bucket.asked) == asked and not bucket.released
        gate.give_back(third)
        await asyncio.sleep(0.1)                                  # LINGER passed: back to the fleet
        assert bucket.released == [slot_key("db", slot)] and gate.take_now() is None and not gate.held

        fourth = await gate.take()
        lingering = fourth.slot
        gate.give_back(fourth)                                    # it lingers ...
        gate.wanted()                                             # ... until a worker elsewhere waits
        await asyncio.sleep(0)                                    # (a release is a task)
        assert gate.take_now() is None and bucket.released[-1] == slot_key("db", lingering)
        fifth = await gate.take()
        waiting = asyncio.ensure_future(gate.take())
        await asyncio.sleep(0)
        released = len(bucket.released)
        gate.give_back(fifth)                                     # back to the fleet, not to our waiter
        await asyncio.sleep(0)
        assert len(bucket.released) == released + 1
        gate.give_back(await waiting)

        gate.wanted_until = 0.0
        old = await gate.take()
        gate.kept[old.slot] -= limits_mod.KEEP_FOR                # taken from the bucket long ago
        released = len(bucket.released)
        gate.give_back(old)
        await asyncio.sleep(0)
        assert len(bucket.released) == released + 1, "kept past KEEP_FOR"

        rated = Gate(FakeBucket(), 1, "api", concurrency=10, rate=100.0)   # type: ignore[arg-type]
        grant = await rated.take()
        rated.give_back(grant)
        assert rated.take_now() is None and not rated.held, "a limit with a rate kept a slot"
        await asyncio.sleep(0)
    asyncio.run(run())


def test_a_parked_job_takes_its_limits_only_when_a_handler_is_free_for_it():
    """Parking (workers/middleware/parking.py) with one handler: the first `room` parked jobs try
    for their limits, where room = handlers (+ the look-ahead, 0 here) - jobs running or queued.
    While the handler runs a job, nothing is taken and the worker asks for no more (`held`); once
    it frees, only the first job tries. Refused (the limit is full) it waits without a handler,
    so the next job in line has its try and the waiter's take is withdrawn; when both wait, the
    first tries again, alone. Before: every parked job had a take under way at once, so a worker
    took slots for jobs queued behind its own busy handler while workers elsewhere, idle, waited."""
    import asyncio
    from types import SimpleNamespace

    from workers import Job
    from workers.middleware.parking import Parking

    class Host:                                    # the limits middleware and the worker, as parking sees them
        table = None

        def __init__(self) -> None:
            self.busy = 1                          # jobs running or queued
            self.gate = SimpleNamespace(index=0, known_full=lambda: False)
            self.takes: dict[int, tuple[asyncio.Future, object]] = {}     # stream seq -> (its take, on_wait)

        def line(self) -> tuple[int, float | None]:
            return self.busy, None

        def wake_pull(self) -> None:
            parking.nudge()

        def first_gate(self, job: Job) -> SimpleNamespace:
            return self.gate

        def take_now(self, job: Job) -> bool:
            return False

        async def hold(self, job: Job, on_wait) -> None:
            future = asyncio.get_running_loop().create_future()
            self.takes[job.stream_seq] = (future, on_wait)
            try:
                await future
            finally:
                del self.takes[job.stream_seq]

        def take_rtt(self) -> float:
            return 0.0

    async def turns() -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    async def run() -> None:
        a, b = (Job(b"x", "jobs.db.w", stream_seq=seq, delivery=1) for seq in (1, 2))
        admitted: list[Job] = []

        def queued(job: Job) -> None:              # the worker's: first in its queue, and it pulls
            admitted.append(job)
            host.busy += 1
            host.wake_pull()
        for job in (a, b):
            parking.park(job, job, queued)
        await turns()
        assert host.takes == {} and parking.occupying() == 2 and parking.pull_state() == (0, True)
        host.busy = 0                              # the handler frees
        host.wake_pull()
        await turns()
        assert set(host.takes) == {1} and parking.pull_state() == (0, True)
        host.takes[1][1](host.gate)                # a: the limit is full
        await turns()
        assert set(host.takes) == {2} and parking.pull_state() == (1, False) and parking.occupying() == 1
        host.takes[2][1](host.gate)                # b too
        await turns()
        assert set(host.takes) == {1} and parking.pull_state() == (2, False) and parking.occupying() == 0
        host.takes[1][0].set_result(None)          # a has its limits
        await turns()
        assert admitted == [a] and host.takes == {} and len(parking) == 1     # b waits for the handler
        host.busy = 0                              # a done
        host.wake_pull()
        await turns()
        assert set(host.takes) == {2}
        parking.close()

    host = Host()
    parking = Parking(host, concurrency=1)         # type: ignore[arg-type]
    asyncio.run(run())
