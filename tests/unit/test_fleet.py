"""Unit tests for the fleet's pure parts (supervisor/parent/tasks/fleet.py, the ledger's lost-peer hooks,
supervisor/parent/safety/peers.py's lost-supervisor messages, supervisor/parent/tasks/monitor.py's SampleGuard).

Every time is a number passed in: no sleeps, no server. The cluster tests are in
tests/integration/test_fleet_cluster.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from supervisor.cli.fleet_status import fleet_rows, render_fleet
from supervisor.core.fleetview import (
    FleetView,
    beat_key,
    lease_key,
    lease_ttl,
    plan_release,
    unlisted_budget,
    unlisted_window,
)
from supervisor.core.lag import LagAnalyzer, Sample
from supervisor.core.ledger import HOLD_MAX, CrashLedger
from supervisor.parent.safety.peers import Peers
from supervisor.parent.tasks.monitor import ACCEPT_AFTER, SampleGuard

OWN = "sup.me.1.aaaaaa"
PEER = "sup.alpha.2.bbbbbb"

# ---------------------------------------------------------------- the view


def beat(name: str = "alpha", hb: float = 1.0, held: list | None = None, **extra) -> dict:
    return {"name": name, "heartbeat": hb, "held": held or [], **extra}


def ticking(view: FleetView, until: float, peer_until: float | None = None, start: float = 0.0) -> None:
    """Our own heartbeat echoes every second from `start` to `until` (server time = 100 + local
    time); the peer beats too until `peer_until`."""
    t = start
    while t <= until:
        view.saw(OWN, beat("me"), 100.0 + t, 1, t)
        if peer_until is not None and t <= peer_until:
            view.saw(PEER, beat(), 100.0 + t, 1, t)
        t += 1.0


def test_a_peer_turns_silent_after_a_missed_beat_and_lost_after_three():
    view = FleetView(OWN, heartbeat=1.0)
    ticking(view, until=10.0, peer_until=5.0)
    peer = view.peers[PEER]
    assert view.state(peer, 5.5) == "ok"
    assert view.state(peer, 7.0) == "silent"
    assert view.state(peer, 8.0) == "silent"          # exactly 3 missed is not more than 3
    assert view.state(peer, 8.2) == "lost"
    assert [p.key for p in view.due_lost(8.2)] == [PEER]
    assert view.age(peer, 8.2) == pytest.approx(3.2)
    assert view.counts(8.2) == {"ok": 0, "silent": 0, "lost": 1, "unknown": 0}


def test_nobody_is_lost_while_our_own_heartbeats_do_not_come_back():
    """A KV outage silences everybody: no echo of our own beat, no ages, no loss."""
    view = FleetView(OWN, heartbeat=1.0)
    ticking(view, until=2.0, peer_until=2.0)
    assert view.state(view.peers[PEER], 30.0) == "unknown" and view.due_lost(30.0) == []
    # The bucket answers again at t=30: the peer's silence counts from then, not from t=2.
    ticking(view, until=32.0, start=30.0)
    assert view.state(view.peers[PEER], 32.0) == "silent"
    ticking(view, until=34.0, start=33.0)
    assert view.state(view.peers[PEER], 33.0) == "silent" and view.state(view.peers[PEER], 33.5) == "lost"


def test_a_new_poller_whose_puts_have_been_working_can_tell_a_lost_peer_at_once():
    view = FleetView(OWN, heartbeat=1.0, channel_since=-20.0)      # our puts have worked for 20 s
    view.saw(PEER, beat(), 95.0, 1, 0.0)                            # the old poller, silent for 5 s
    view.saw(OWN, beat("me"), 100.0, 1, 0.0)
    assert view.state(view.peers[PEER], 0.0) == "lost"
    fresh = FleetView(OWN, heartbeat=1.0)                           # no such evidence: wait 3 beats
    fresh.saw(PEER, beat(), 95.0, 1, 0.0)
    fresh.saw(OWN, beat("me"), 100.0, 1, 0.0)
    assert fresh.state(fresh.peers[PEER], 0.0) == "silent"


def test_the_peers_own_heartbeat_period_counts():
    view = FleetView(OWN, heartbeat=1.0)
    ticking(view, until=0.0)
    view.saw(PEER, beat(hb=5.0), 100.0, 1, 0.0)
    ticking(view, until=15.0, start=1.0)
    assert view.state(view.peers[PEER], 14.0) == "silent"     # a 1 s heartbeat would be lost long ago
    assert view.state(view.peers[PEER], 15.0) == "silent"
    assert view.state(view.peers[PEER], 15.5) == "lost"


def test_a_marked_peer_stays_lost_with_the_time_it_was_last_seen_and_a_deleted_one_goes():
    view = FleetView(OWN, heartbeat=1.0)
    ticking(view, until=10.0)
    view.saw(PEER, beat(lost={"by": "beta", "server_t": 95.0}), 109.0, 7, 9.0)
    peer = view.peers[PEER]
    assert peer.marked and view.state(peer, 10.0) == "lost" and view.age(peer, 10.0) == pytest.approx(15.0)
    assert view.due_lost(10.0) == []                   # already handled by whoever marked it
    view.gone(PEER)
    assert view.peers == {}


def reply(consumer: str, seq: int, delivery: int = 1) -> str:
    return f"$JS.ACK.JOBS.{consumer}.{delivery}.{seq}.{seq}.1796162710029000000.0"


def test_held_by_live_skips_lost_peers_and_keeps_each_consumers_delivery_apart():
    """A fan-out (pools on one subject off a work queue): seq 5 is one message, delivered by
    consumers a and b each on its own; b's delivery 1 says nothing about a's delivery 2."""
    view = FleetView(OWN, heartbeat=1.0)
    ticking(view, until=10.0)
    view.saw("sup.a.1.x", beat("a", held=[[5, 2, 0.1, reply("wa", 5, 2), "held"], [6, 1, 0.1, "r", "running"]],
                               consumer="wa"), 109.5, 1, 9.5)
    view.saw("sup.c.1.x", beat("c", held=[[5, 1, 0.1, reply("wb", 5), "held"]]), 109.5, 1, 9.5)
    view.saw("sup.b.1.x", beat("b", held=[[5, 3, 3.0, reply("wa", 5, 3), "running"]]), 100.0, 1, 0.0)   # lost
    assert view.held_by_live(10.0) == {("wa", 5): 2, ("wa", 6): 1, ("wb", 5): 1}


def test_each_consumers_poller_acts_on_a_loss_for_its_own_consumer_once():
    """Per-consumer leases: the poller of wa and the poller of wb each act on host h's loss for
    their consumer, one after the other through the mark in h's entry; a consumer h never ran,
    and a mark by a poller of one lease per fleet (older: it acted for everyone), leave nothing."""
    view = FleetView(OWN, heartbeat=1.0)
    ticking(view, until=10.0)
    view.saw(PEER, beat(consumers={"wa": {"capacity": 2}, "wb": {"capacity": 2}}), 100.0, 1, 0.0)
    wa, wb, wc = frozenset({"wa"}), frozenset({"wb"}), frozenset({"wc"})
    assert [p.key for p in view.due_lost(10.0, wa)] == [PEER] and view.todo(view.peers[PEER], wa | wc) == wa
    assert view.due_lost(10.0, wc) == []
    view.saw(PEER, beat(consumers={"wa": {}, "wb": {}}, lost={"server_t": 100.0, "consumers": ["wa"]}), 110.0, 2, 10.0)
    assert view.due_lost(10.0, wa) == [] and view.todo(view.peers[PEER], wa | wb) == wb
    assert view.state(view.peers[PEER], 10.0) == "lost" and view.age(view.peers[PEER], 10.0) == pytest.approx(10.0)
    view.saw(PEER, beat(consumers=["wa", "wb"], lost={"server_t": 100.0}), 110.0, 3, 10.0)     # an older poller's mark
    assert view.due_lost(10.0, wa | wb) == []
    old = "sup.old.1.x"                                 # a beat older than pools names no consumer: anybody's
    view.saw(old, beat("old"), 100.0, 1, 0.0)
    assert view.todo(view.peers[old], wb) == wb and view.due_lost(10.0) == [view.peers[old]]


def test_a_lost_hosts_unlisted_jobs_are_counted_per_consumer():
    """Host h ran pool a (capacity 4, 1 job listed) and pool b (capacity 1, none): the window of
    b explains at most 1 redelivery, not a's 3 (an older beat: its whole capacity less all listed)."""
    per = beat(capacity=5, held_total=1, held=[[7, 1, 0.1, reply("wa", 7), "running"]],
               consumers={"wa": {"capacity": 4, "held": 1}, "wb": {"capacity": 1, "held": 0}})
    assert unlisted_budget(per, "wa", 1) == 3 and unlisted_budget(per, "wb", 0) == 1
    over = beat(consumers={"wa": {"capacity": 4, "held": 9}})          # held more than it could list
    assert unlisted_budget(over, "wa", 2) == 7
    older = beat(capacity=5, held_total=1, held=[[7, 1, 0.1, "r", "running"]], consumers=["wa", "wb"])
    assert unlisted_budget(older, "wb", 0) == 4


# ---------------------------------------------------------------- releasing a lost peer's jobs

def test_release_naks_only_jobs_with_ack_wait_left_and_not_seen_again():
    held = [[1, 1, 0.5, "$JS.ACK.1", "running"], [2, 3, 21.0, "$JS.ACK.2", "running"],
            [3, 1, 1.0, "$JS.ACK.3", "held"], [4, 1, 1.0, "", "held"], [5, 2, 0.0, "$JS.ACK.5", "held"],
            [6, 1, 0.5, "$JS.ACK.6", "acked"]]
    plan = plan_release(held, since_beat=3.0, ack_wait_for=lambda d: 30.0,
                        later_delivery=lambda seq: {3: 2, 5: 2}.get(seq, 0))
    assert plan.nak == [(1, 1, "$JS.ACK.1"), (5, 2, "$JS.ACK.5")]      # seen at its own delivery: still its
    why = {seq: reason for seq, _, reason in plan.skipped}
    assert set(why) == {2, 3, 4, 6}
    assert "AckWait nearly out (6.0s left)" == why[2]                # 30 - 21 - 3 <= 20 % of 30
    assert "seen again at delivery 2" == why[3]
    assert why[4] == "no reply subject"
    assert why[6] == "acked before the last heartbeat"


@pytest.mark.parametrize("ack_wait,age,nak", [(5.0, 3.5, False), (5.0, 2.5, True), (60.0, 49.0, False),
                                              (60.0, 47.0, True)])
def test_release_margin_is_two_seconds_or_a_fifth_of_ack_wait(ack_wait, age, nak):
    plan = plan_release([[9, 1, age, "r", "running"]], since_beat=0.0, ack_wait_for=lambda d: ack_wait,
                        later_delivery=lambda seq: 0)
    assert bool(plan.nak) is nak


def test_unlisted_jobs_come_back_between_ack_wait_after_the_last_beat_and_after_now():
    assert unlisted_window(since_beat=3.0, ack_waits=(30.0, 30.0)) == (25.0, 32.0)
    assert unlisted_window(since_beat=3.0, ack_waits=(10.0, 60.0)) == (5.0, 62.0)


# ---------------------------------------------------------------- the ledger told about a lost peer

def test_a_lost_peers_jobs_are_explained_as_its_own_everywhere():
    led = CrashLedger(ack_wait=30.0, poison_after=3)
    peers = Peers(None, "JOBS", "workers", led, post=lambda work: work())
    peers.lost_peer("alpha", [(7, 1), (8, 2)], window=(-1.0, 60.0), budget=2)
    now = time.monotonic()          # lost_peer dates the window from the monotonic clock
    assert led.redelivered(now, 7, 2) == "held by lost supervisor alpha"
    assert led.redelivered(now, 8, 3) == "held by lost supervisor alpha"
    assert led.redelivered(now, 50, 2) == "taken by lost supervisor alpha after its last heartbeat"
    assert led.redelivered(now, 51, 2) == "taken by lost supervisor alpha after its last heartbeat"
    assert led.redelivered(now, 52, 2) == ""            # over the budget: a suspect like any other
    assert led.counts["lost_peer_redeliveries"] == 4
    cc = led.crosscheck(now)
    assert cc["lost_peer_redeliveries"] == 4
    assert [(r["stream_seq"], r["why"].split(" after")[0]) for r in cc["recent_cluster_explained"]] == [
        (7, "held by lost supervisor alpha"), (8, "held by lost supervisor alpha"),
        (50, "taken by lost supervisor alpha"), (51, "taken by lost supervisor alpha")]
    assert peers.outbox["lost"][0]["held"] == [[7, 1], [8, 2]]


def test_the_lost_message_from_another_supervisor_explains_here():
    led = CrashLedger(ack_wait=30.0, poison_after=3)
    peers = Peers(None, "JOBS", "workers", led, post=lambda work: work())
    led.redelivered(0.0, 7, 2)                          # arrived before the word: a suspect
    msg = type("Msg", (), {"data": json.dumps({"origin": "elsewhere/1", "lost": [
        {"name": "alpha", "held": [[7, 1]], "window": [0.0, 1.0], "budget": 0}]}).encode()})
    asyncio.run(peers.on_message(msg))
    assert led.confirm_suspects(100.0, grace=2.0) == []
    assert led.counts["lost_peer_redeliveries"] == 1 and led.counts["unexplained_redeliveries"] == 0


def test_suspects_wait_while_a_peer_is_silent_but_not_forever():
    led = CrashLedger(ack_wait=30.0, poison_after=3)
    assert led.redelivered(0.0, 5, 2) == ""
    led.hold_suspects(10.0)
    assert led.confirm_suspects(5.0, grace=2.0) == []
    assert [r.seq for r in led.confirm_suspects(10.5, grace=2.0)] == [5]
    led.redelivered(20.0, 6, 2)
    led.hold_suspects(10_000.0)                         # a peer silent "for ever" (a stuck poller)
    assert led.confirm_suspects(20.0 + 2.0 + HOLD_MAX - 0.1, grace=2.0) == []
    assert [r.seq for r in led.confirm_suspects(20.0 + 2.0 + HOLD_MAX, grace=2.0)] == [6]


def test_a_window_explains_suspects_already_waiting_in_it():
    led = CrashLedger(ack_wait=30.0, poison_after=3)
    for seq in (1, 2, 3):
        led.redelivered(10.0 + seq, seq, 2)
    led.expect_window(11.5, 20.0, budget=1, why="taken by lost supervisor alpha after its last heartbeat")
    assert [r.seq for r in led.confirm_suspects(100.0, grace=2.0)] == [1, 3]      # 1 before it, 3 over budget


def test_a_lost_supervisors_window_beats_a_leader_moves_where_both_cover_a_redelivery():
    """Seen on the cluster: a job the killed host took after its last heartbeat came back inside
    an earlier leader move's window and was put down to the move, not to the lost host."""
    led = CrashLedger(ack_wait=30.0, poison_after=3)
    led.expect_window(0.0, 50.0, budget=5, why="ack possibly lost while the consumer leader moved (n3 -> n2)",
                      counter="leader_move_redeliveries")
    led.expect_window(10.0, 60.0, budget=1, why="taken by lost supervisor alpha after its last heartbeat")
    assert led.redelivered(20.0, 42, 2) == "taken by lost supervisor alpha after its last heartbeat"
    assert led.redelivered(21.0, 43, 2).startswith("ack possibly lost")     # the lost host's budget is spent
    assert (led.counts["lost_peer_redeliveries"], led.counts["leader_move_redeliveries"]) == (1, 1)


# ---------------------------------------------------------------- the ConsumerInfo guard

CREATED = "2026-11-30T22:10:37.864487+00:00"
# Recorded on the 3-node test cluster (tests/support/natscluster.py) under steady load, polling every
# 0.1 s: a consumer step-down (n2 -> n1 at 3.07 s), the consumer leader SIGKILLed (n1 -> n2 at
# 14.23 s, the polls in between timed out). Every 10th sample, and all around a leader change.
# (t, leader, delivered, ack floor, pending, ack pending, redelivered, waiting, delivered/ack floor stream seq)
RECORDED = [
    (0.0, 'n2', 0, 0, 0, 0, 0, 0, 0, 0),
    (1.03, 'n2', 146, 144, 0, 2, 0, 0, 146, 144),
    (2.05, 'n2', 296, 294, 0, 2, 0, 0, 296, 294),
    (2.87, 'n2', 413, 412, 0, 2, 0, 0, 413, 412),
    (2.97, 'n2', 429, 427, 0, 2, 0, 0, 429, 427),
    (3.07, 'n1', 443, 432, 1, 4, 0, 0, 443, 432),
    (3.17, 'n1', 459, 432, 0, 4, 0, 0, 459, 432),
    (4.09, 'n1', 588, 432, 0, 3, 0, 1, 588, 432),
    (5.11, 'n1', 731, 432, 0, 4, 0, 0, 731, 432),
    (6.14, 'n1', 869, 432, 0, 4, 0, 0, 869, 432),
    (7.16, 'n1', 1010, 432, 0, 3, 0, 1, 1010, 432),
    (8.19, 'n1', 1153, 1151, 0, 2, 0, 0, 1151, 1149),
    (14.23, 'n2', 1421, 1410, 632, 3, 0, 0, 1417, 1406),
    (15.25, 'n2', 1621, 1602, 588, 18, 0, 0, 1617, 1598),
    (16.27, 'n2', 1801, 1791, 571, 10, 0, 0, 1797, 1787),
    (17.3, 'n2', 1981, 1970, 543, 3, 0, 0, 1977, 1966),
    (18.33, 'n2', 2181, 2161, 453, 20, 0, 0, 2177, 2157),
    (19.35, 'n2', 2361, 2343, 273, 17, 0, 0, 2357, 2339),
    (20.37, 'n2', 2541, 2526, 93, 11, 0, 0, 2537, 2522),
    (21.38, 'n2', 2634, 2634, 0, 0, 0, 2, 2630, 2630),
    (22.4, 'n2', 2634, 2634, 0, 0, 0, 3, 2630, 2630),
    (23.42, 'n2', 2634, 2634, 0, 0, 0, 2, 2630, 2630),
    (24.44, 'n2', 2634, 2634, 0, 0, 0, 3, 2630, 2630),
    (25.47, 'n2', 2748, 2746, 0, 2, 0, 0, 2744, 2742),
    (26.49, 'n2', 2892, 2891, 0, 1, 0, 1, 2888, 2887),
]
# What a leader that has just taken over without the consumer's state would answer.
FRESH_LEADER = (14.33, 'n3', 0, 0, 2019, 0, 0, 0, 0, 0)


def consumer(row: tuple, created: str = CREATED) -> dict:
    t, leader, dseq, fseq, pending, ackp, redel, waiting, dsseq, fsseq = row
    return {"leader": leader, "delivered_consumer_seq": dseq, "ack_floor_consumer_seq": fseq, "num_pending": pending,
            "num_ack_pending": ackp, "num_redelivered": redel, "num_waiting": waiting,
            "delivered_stream_seq": dsseq, "ack_floor_stream_seq": fsseq, "created": created}


def as_sample(row: tuple) -> Sample:
    c = consumer(row)
    return Sample(t=row[0], num_pending=c["num_pending"], num_ack_pending=c["num_ack_pending"],
                  num_redelivered=c["num_redelivered"], delivered_consumer_seq=c["delivered_consumer_seq"],
                  ack_floor_consumer_seq=c["ack_floor_consumer_seq"], local_acked=0, progress_alive=False)


def test_guard_passes_every_sample_of_a_real_leader_move_recording():
    guard = SampleGuard()
    assert [guard.check(consumer(r)) for r in RECORDED] == [""] * len(RECORDED)
    assert guard.skipped == 0


def test_guard_keeps_a_fresh_leaders_zeros_out_of_the_lag_analysis():
    rows = RECORDED[:13] + [FRESH_LEADER] + RECORDED[13:]
    guard, guarded, raw = SampleGuard(), LagAnalyzer(60.0, 30.0, 1.0), LagAnalyzer(60.0, 30.0, 1.0)
    for row in rows:
        raw.add(as_sample(row))
        if not guard.check(consumer(row)):
            guarded.add(as_sample(row))
    assert guard.skipped == 1
    assert len(guarded.samples) == len(RECORDED)
    # Unguarded, the zeros read as a recreated consumer: the history before them is gone.
    assert len(raw.samples) == len(rows) - 13
    assert guarded.report(27.0).state == "ok"


def test_guard_takes_a_recreated_consumer_at_once():
    guard = SampleGuard()
    assert guard.check(consumer(RECORDED[5])) == ""
    assert guard.check(consumer(RECORDED[0], created="2026-12-01T00:00:00+00:00")) == ""


def test_guard_gives_in_to_backward_numbers_that_persist():
    guard = SampleGuard()
    guard.check(consumer(RECORDED[10]))
    verdicts = [guard.check(consumer(RECORDED[2])) for _ in range(ACCEPT_AFTER)]
    assert all(verdicts[:-1]) and verdicts[-1] == "" and guard.skipped == ACCEPT_AFTER - 1
    assert "went back" in verdicts[0]


def test_guard_skips_an_ack_floor_above_delivered():
    guard = SampleGuard()
    bad = consumer((1.0, 'n1', 10, 12, 0, 0, 0, 0, 10, 12))
    assert "above delivered" in guard.check(bad)


# ---------------------------------------------------------------- `status --fleet` rows

def test_fleet_rows_have_the_spec_keys_and_mark_lost_after_three_beats():
    beats = [(beat("beta", hb=2.0, host="h2", pid=20, workers={"ready": 2, "target": 2}, jobs_per_s=4.5,
                   crashes=1), 1000.0),
             (beat("alpha", hb=2.0, host="h1", pid=10, workers={"ready": 1, "target": 2}), 994.5),
             (beat("gamma", hb=2.0, host="h3", pid=30, lost={"by": "beta", "server_t": 990.0}), 1000.0)]
    rows = fleet_rows(beats, now=1000.5)
    assert [(r["name"], r["state"]) for r in rows] == [("alpha", "ok"), ("beta", "ok"), ("gamma", "lost")]
    later = {r["name"]: r["state"] for r in fleet_rows(beats, now=1000.6)}
    assert later == {"alpha": "lost", "beta": "ok", "gamma": "lost"}          # alpha: 6.1 s > 3 x 2 s
    spec = {"name", "host", "pid", "state", "workers", "jobs_per_s", "crashes", "last_seen_s"}
    assert all(spec <= set(r) for r in rows) and rows[1]["workers"] == {"ready": 2, "target": 2}
    assert rows[2]["last_seen_s"] == 10.5
    text = render_fleet({"supervisors": rows, "consumer": {"stream": "JOBS", "name": "workers", "error": "x"}})
    assert "gamma" in text and "lost" in text and "JOBS/workers: x" in text


def test_keys_are_valid_kv_keys_and_the_lease_lasts_whole_seconds():
    assert beat_key("web 01.example.com", 42, "a1b2c3") == "sup.web_01_example_com.42.a1b2c3"
    assert beat_key("...", 1, "x") == "sup.supervisor.1.x"
    assert lease_ttl(2.0) == 6 and lease_ttl(0.1) == 1 and lease_ttl(0.5) == 2
    assert lease_key("JOBS", "workers-email") == "poller.JOBS.workers-email"


# ---------------------------------------------------------------- fleet-wide progress, failover polling

def test_progress_sums_the_live_peers_acks_and_sees_their_long_jobs():
    view = FleetView(OWN, heartbeat=1.0)
    ticking(view, until=10.0)
    view.saw("sup.a.1.x", beat("a", acked=40, busy=False), 109.5, 1, 9.5)
    view.saw("sup.b.1.x", beat("b", acked=7, busy=True), 109.5, 1, 9.5)
    view.saw("sup.c.1.x", beat("c", acked=1000, busy=True), 100.0, 1, 0.0)         # lost: not counted
    assert view.progress(10.0) == (47, True)
    # Per consumer: a beat's numbers for that consumer; an older beat's only for the consumer it names.
    view.saw("sup.d.1.x", beat("d", acked=5, consumer="wa", consumers={"wa": {"acked": 5}, "wb": {"acked": 2,
                                                                                               "busy": True}}),
             109.5, 1, 9.5)
    view.saw("sup.e.1.x", beat("e", acked=3, busy=False, consumer="wa"), 109.5, 1, 9.5)
    assert view.progress(10.0, "wb") == (2 + 47, True) and view.progress(10.0, "wa") == (5 + 3 + 47, True)


def test_fallback_polls_spread_over_a_big_fleet_and_every_interval_in_a_small_one():
    from supervisor.core.fleetview import FALLBACK_POLLS, Fallback

    small = Fallback(rng=lambda: 0.5)
    assert [small.due(t / 10, 1.0, peers=3) for t in range(0, 30)].count(True) == 3 - 1 + 1   # t=0.5, 1.5, 2.5
    big = [Fallback(rng=lambda i=i: i / 1000) for i in range(1000)]
    polls = sum(f.due(t / 10, 1.0, peers=999) for t in range(0, 200) for f in big)      # 20 s of ticks
    assert polls <= 20 * FALLBACK_POLLS * 1.1


def test_the_simulated_fleet_polls_once_per_interval_and_survives_a_failover_gently():
    from bench.fleet_sim import announcements_per_crash, simulate
    from supervisor.core.fleetview import FALLBACK_POLLS

    naive = simulate(40, "naive", seconds=40.0, kill_poller_at=None)
    elected = simulate(40, "elected", seconds=40.0, kill_poller_at=None)
    assert sum(naive.polls(10, 40)) == pytest.approx(40 * 30, rel=0.05)
    assert sum(elected.polls(10, 40)) == pytest.approx(30, abs=2)
    assert elected.kv_deliveries < naive.kv_deliveries / 30
    failover = simulate(40, "elected", seconds=40.0, kill_poller_at=20.0)
    assert max(failover.polls(20, 40)) <= 2 * FALLBACK_POLLS        # random phases: ~FALLBACK_POLLS a second
    assert 0 < failover.pollerless_s <= lease_ttl(2.0) + 2.0
    assert announcements_per_crash() == (3, announcements_per_crash()[1])   # naks, seen, settled


def test_an_orphans_nak_times_count_only_from_this_host_and_its_goodbye_only_when_fenced():
    """F9 (supervisor/parent/safety/peers.py): an orphan's NAK times are its host's monotonic clock."""
    from types import SimpleNamespace

    from supervisor.parent.safety import peers as peers_module

    class Sink:
        def __init__(self) -> None:
            self.naks: list[tuple] = []
            self.read: list[str] = []

        def worker_nak(self, seq, delivery, at, delay, held_at, now, by=""):
            self.naks.append((seq, delivery, at, delay, held_at, by))

        def naks_read(self, origin, now):
            self.read.append(origin)

    sink = Sink()
    led = CrashLedger(30.0, 2)
    peers = Peers(None, "JOBS", "workers", led, post=lambda work: work(), in_transit=sink)
    orphan = "vm/41/ab12cd34 (worker 0, orphan of pid 40)"

    def say(body: dict) -> None:
        asyncio.run(peers.on_message(SimpleNamespace(data=json.dumps(body).encode())))
    naked = [[7, 1, 100.5, 2.0, 99.0]]
    say({"origin": orphan, "naks": [[7, "NAKed by worker 0"]], "naked": naked, "boot": "another host's"})
    say({"origin": orphan, "naks": [[7, "NAKed by worker 0"]], "naked": naked})
    assert sink.naks == []
    say({"origin": orphan, "naks": [[7, "NAKed by worker 0"]], "naked": naked, "boot": peers_module.BOOT})
    assert sink.naks == [(7, 1, 100.5, 2.0, 99.0, orphan)]
    say({"origin": orphan, "bye": 1})
    assert sink.read == [] and orphan in peers.gone
    say({"origin": orphan, "bye": 1, "fenced": 1})
    assert sink.read == [orphan]
    # Its record from the fleet bucket (read by a supervisor that was not listening yet): the
    # NAKs first, then the goodbye, in one; a ledger message with "bye" alone is only a goodbye.
    later, sink.naks, sink.read = "vm/42/cd (worker 1, orphan of pid 40)", [], []
    record = {"origin": later, "naks": [[8, "NAKed by worker 1"]], "naked": [[8, 1, 101.0, 2.0, 99.5]],
              "boot": peers_module.BOOT, "bye": 1, "fenced": 1, "consumer": "workers"}
    peers.receive(dict(record), record=True)
    assert sink.naks == [(8, 1, 101.0, 2.0, 99.5, later)] and sink.read == [later] and later in peers.gone
    assert led.expecting(8)
    peers.receive({"origin": "vm/43/ef (worker 2, orphan of pid 40)", "naked": [[9, 1, 1.0, 2.0, 1.0]],
                   "boot": peers_module.BOOT, "bye": 1})
    assert [n[0] for n in sink.naks] == [8]
