"""`python -m bench.fleet_sim`: the fleet on paper. A discrete-event simulation with a fake clock of
N hosts x W workers against one consumer, counting what each design asks of the NATS cluster.

Two designs:
- `naive`: what one supervisor per host does on its own: every parent polls ConsumerInfo every
  `monitor.interval` and watches every heartbeat in the fleet bucket.
- `elected` (what supervisor/parent/tasks/fleet.py does): one poller per fleet, elected through a lease key
  (a fake KV below with the real semantics: create-if-absent, revision-checked renew, a
  per-message TTL). Only it polls ConsumerInfo and watches the heartbeats; it broadcasts each
  sample (core NATS) to everybody. A member polls itself only when no sample came for
  SAMPLE_FRESH intervals (the poller died: the lease must expire first).

Every host heartbeats. Ledger announcements per crash are counted by running the real
supervisor/parent/safety/peers.py `Peers` over a counting connection: a worker dies holding jobs (one "naks"
message), one of them lands on another host ("seen"), is acked there ("settled"). Each message
goes to every other supervisor, and so does each supervisor's "hello" every HELLO_EVERY seconds
(how a supervisor knows it is alone, for the in-transit reconciliation).

Loads are converted to cluster CPU with per-operation costs measured on the 3-node test cluster
(`python -m bench.fleet costs`; the defaults below are that command's output on the machine in
docs/FLEET.md). Prints a Markdown table; `--json` for the raw numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from supervisor.core.fleetview import LOST_AFTER, Fallback, lease_ttl
from supervisor.core.ledger import CrashLedger
from supervisor.parent.safety.peers import HELLO_EVERY, Peers
from supervisor.parent.tasks.fleet import SAMPLE_FRESH

# Cluster CPU per operation (microseconds, all three nodes together), from `python -m bench.fleet costs`.
COSTS_US = {"consumer_info": 480.0, "kv_put": 545.0, "kv_delivery": 51.0, "core_delivery": 1.3}
WARM_UP = 10.0                  # simulated seconds before the steady-state rates are counted


@dataclass
class Counts:
    seconds: float = 0.0
    consumer_info: int = 0          # ConsumerInfo requests
    kv_puts: int = 0                # heartbeats + lease writes (each replicated to 3 nodes)
    kv_deliveries: int = 0          # heartbeats delivered to watchers
    core_deliveries: int = 0        # broadcast samples and summaries delivered
    pollerless_s: float = 0.0       # longest stretch with no poller (a failover)
    polls_by_second: dict = field(default_factory=dict)

    def rate(self, n: int) -> float:
        return n / self.seconds

    def poll_at(self, t: float) -> None:
        self.consumer_info += 1
        self.polls_by_second[int(t)] = self.polls_by_second.get(int(t), 0) + 1

    def polls(self, start: float, end: float) -> list[int]:
        return [self.polls_by_second.get(s, 0) for s in range(int(start), int(end))]


class FakeKV:
    """The lease key's server-side semantics: create only when absent, renew only at the current
    revision, gone once its TTL has passed without a renewal."""

    def __init__(self) -> None:
        self.rev, self.holder, self.expires = 0, None, 0.0

    def create(self, who: int, now: float, ttl: float) -> int:
        if self.holder is not None and now < self.expires:
            return 0
        self.rev, self.holder, self.expires = self.rev + 1, who, now + ttl
        return self.rev

    def renew(self, who: int, rev: int, now: float, ttl: float) -> int:
        if self.holder != who or rev != self.rev or now >= self.expires:
            return 0
        self.rev, self.expires = self.rev + 1, now + ttl
        return self.rev


@dataclass
class Host:
    id: int
    fallback: Fallback
    alive: bool = True
    lease_rev: int = 0
    summary_at: float = -1e9        # last word from a poller
    sample_at: float = -1e9         # last ConsumerInfo sample from a poller
    peers: int = 0                  # as the poller last said


@dataclass
class World:
    design: str
    heartbeat: float
    interval: float
    hosts: list[Host]
    kv: FakeKV = field(default_factory=FakeKV)
    counts: Counts = field(default_factory=Counts)
    pollers: set[int] = field(default_factory=set)      # ids of live hosts that think they hold the lease

    def set_lease(self, host: Host, rev: int) -> None:
        host.lease_rev = rev
        (self.pollers.add if rev and host.alive else self.pollers.discard)(host.id)


def simulate(hosts: int, design: str, seconds: float = 120.0, heartbeat: float = 2.0, interval: float = 1.0,
             kill_poller_at: float | None = 60.0, seed: int = 1) -> Counts:
    rng = random.Random(seed)
    world = World(design, heartbeat, interval, [Host(i, Fallback(rng.random)) for i in range(hosts)])
    world.counts.seconds = seconds
    events: list[tuple[float, int, str, int]] = []
    order = iter(range(10**9))
    for h in world.hosts:          # random phases: hosts start at different moments
        heapq.heappush(events, (rng.uniform(0, heartbeat), next(order), "beat", h.id))
        heapq.heappush(events, (rng.uniform(0, interval), next(order), "poll", h.id))
    if kill_poller_at is not None:
        heapq.heappush(events, (kill_poller_at, next(order), "kill", -1))
    alive, no_poller_since = hosts, None
    while events:
        t, _, what, who = heapq.heappop(events)
        if t > seconds:
            break
        if what == "kill":
            victim = world.hosts[min(world.pollers) if world.pollers else 0]
            victim.alive, alive = False, alive - 1
            world.set_lease(victim, 0)
            continue
        host = world.hosts[who]
        if not host.alive:
            continue
        if what == "beat":
            beat(world, host, t, alive)
            heapq.heappush(events, (t + heartbeat, next(order), "beat", who))
        else:
            poll(world, host, t)
            heapq.heappush(events, (t + interval, next(order), "poll", who))
        if design == "elected" and t > heartbeat:
            polling = bool(world.pollers)
            if not polling and no_poller_since is None:
                no_poller_since = t
            elif polling and no_poller_since is not None:
                world.counts.pollerless_s = max(world.counts.pollerless_s, t - no_poller_since)
                no_poller_since = None
    return world.counts


def beat(world: World, host: Host, t: float, alive: int) -> None:
    """Fleet.tick: the heartbeat put, then the lease (renew it, or take it when no poller talks)."""
    counts = world.counts
    counts.kv_puts += 1
    if world.design == "naive":
        counts.kv_deliveries += alive            # every parent watches every heartbeat
        return
    counts.kv_deliveries += len(world.pollers)
    ttl = lease_ttl(world.heartbeat)
    if host.lease_rev:
        counts.kv_puts += 1
        world.set_lease(host, world.kv.renew(host.id, host.lease_rev, t, ttl))
    elif t - host.summary_at >= LOST_AFTER * world.heartbeat:
        counts.kv_puts += 1                     # a create attempt is a write request either way
        world.set_lease(host, world.kv.create(host.id, t, ttl))
    if host.lease_rev:                          # the poller's fleet summary, once per beat
        broadcast(world, host, t, sample=False)


def poll(world: World, host: Host, t: float) -> None:
    """Monitor.poll: the poller's sample while fresh, else ConsumerInfo at the Fallback pace."""
    if world.design == "elected" and not host.lease_rev:
        if t - host.sample_at <= SAMPLE_FRESH * world.interval:
            host.fallback.reset()
            return
        if host.sample_at > 0 and not host.fallback.due(t, world.interval, host.peers):
            return                              # (never had a sample: just started, polls at once)
    world.counts.poll_at(t)
    if world.design == "elected" and host.lease_rev:
        broadcast(world, host, t, sample=True)


def broadcast(world: World, poller: Host, t: float, sample: bool) -> None:
    peers = sum(1 for h in world.hosts if h.alive) - 1
    for h in world.hosts:
        if h.alive and h is not poller:
            world.counts.core_deliveries += 1
            h.summary_at, h.peers = t, peers
            if sample:
                h.sample_at = t


class CountingNC:
    is_connected = True

    def __init__(self) -> None:
        self.published: list[int] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append(len(data))


def announcements_per_crash(held: int = 2) -> tuple[int, int]:
    """(messages published, bytes) by the real Peers for one worker death holding `held` jobs,
    one of them redelivered to and acked on another host."""
    nc_a, nc_b = CountingNC(), CountingNC()
    a = Peers(nc_a, "JOBS", "workers", CrashLedger(30.0, 3), post=lambda work: work())
    b = Peers(nc_b, "JOBS", "workers", CrashLedger(30.0, 3), post=lambda work: work())
    a.last_hello = b.last_hello = time.monotonic()      # the periodic hello is counted apart (hellos_per_s)
    for seq in range(100, 100 + held):                 # Arbiter.settle_held_jobs
        a.announce(seq, "held by worker 3 (pid 4242) at its death (killed by SIGKILL)")
    asyncio.run(a.flush())
    b.seen(100, 2)                                     # Arbiter.apply_event, then audit's flush
    asyncio.run(b.flush())
    b.settled(100, 2, "ack")
    asyncio.run(b.flush())
    sizes = nc_a.published + nc_b.published
    return len(sizes), sum(sizes)


def row(hosts: int, workers: int, design: str, args: argparse.Namespace) -> dict[str, Any]:
    """Steady state from a run without a failure (after a warm-up of 10 s), the failover from a
    run where the poller (or, naive, any host) dies at --kill-at."""
    steady = simulate(hosts, design, args.seconds, args.heartbeat, args.interval, None)
    failover = simulate(hosts, design, args.seconds, args.heartbeat, args.interval, args.kill_at)
    span = args.seconds - WARM_UP
    polls = sum(steady.polls(WARM_UP, args.seconds)) / span
    burst = failover.polls(args.kill_at, args.kill_at + 20)
    msgs, size = announcements_per_crash()
    kv_puts, kv_deliveries, core = (steady.rate(steady.kv_puts), steady.rate(steady.kv_deliveries),
                                    steady.rate(steady.core_deliveries))
    hellos = hosts * (hosts - 1) / HELLO_EVERY      # Peers' "I exist" to every other supervisor (both designs)
    cpu = (polls * COSTS_US["consumer_info"] + kv_puts * COSTS_US["kv_put"] + kv_deliveries * COSTS_US["kv_delivery"]
           + (core + hellos) * COSTS_US["core_delivery"])
    return {"hosts": hosts, "workers": hosts * workers, "design": design,
            "heartbeats_per_s": round(hosts / args.heartbeat, 1), "kv_writes_per_s": round(kv_puts, 1),
            "kv_deliveries_per_s": round(kv_deliveries, 1), "consumer_info_per_s": round(polls, 1),
            "failover_worst_second": max(burst), "failover_extra_polls": sum(burst) - round(polls * len(burst)),
            "samples_delivered_per_s": round(core, 1), "hellos_delivered_per_s": round(hellos, 1),
            "ledger_msgs_per_crash": msgs,
            "ledger_deliveries_per_crash": msgs * (hosts - 1), "ledger_bytes_per_crash": size,
            "pollerless_s": round(failover.pollerless_s, 1), "cluster_cpu_pct": round(cpu / 1e4, 2)}


COLUMNS = (("hosts", "hosts"), ("workers", "workers"), ("design", "design"), ("heartbeats_per_s", "beats/s"),
           ("kv_writes_per_s", "KV writes/s"), ("kv_deliveries_per_s", "KV deliveries/s"),
           ("consumer_info_per_s", "ConsumerInfo/s"), ("failover_worst_second", "ConsumerInfo, worst second of a failover"),
           ("pollerless_s", "no poller (s)"), ("samples_delivered_per_s", "samples delivered/s"),
           ("hellos_delivered_per_s", "ledger hellos delivered/s"),
           ("ledger_deliveries_per_crash", "ledger msgs delivered per crash"), ("cluster_cpu_pct", "cluster CPU %"))


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[k]) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_sim", description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--workers", type=int, default=16, help="per host")
    p.add_argument("--seconds", type=float, default=120.0, help="simulated time")
    p.add_argument("--heartbeat", type=float, default=2.0, help="fleet.heartbeat")
    p.add_argument("--interval", type=float, default=1.0, help="monitor.interval")
    p.add_argument("--kill-at", type=float, default=60.0, help="kill the poller at this simulated second")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [row(n, args.workers, design, args) for n in args.hosts for design in ("naive", "elected")]
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
