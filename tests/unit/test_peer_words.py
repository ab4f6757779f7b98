"""F13: a peer's word on the ledger subject delayed or lost by a link fault (supervisor/core/hearing.py,
the ledger's `caught_up` hold, Peers' numbering and its asks)."""

from __future__ import annotations

import json
import math

from supervisor.core.hearing import ASK_EVERY, ASK_TRIES, KEEP, Heard, Said
from supervisor.core.ledger import HOLD_MAX, CrashLedger
from supervisor.parent.safety.peers import Peers


def test_a_gap_in_a_peers_numbers_is_asked_for_until_it_comes():
    heard = Heard()
    assert heard.take("b", 7, 0.0)                 # first word: what came before is not ours to miss
    assert heard.take("b", 10, 1.0)                # 8 and 9 lost
    assert heard.missing() == 2
    asks, lost = heard.to_ask(1.0)
    assert asks == {"b": [8, 9]} and lost == {}
    assert heard.to_ask(1.0 + ASK_EVERY / 2) == ({}, {})      # not again at once
    assert heard.take("b", 9, 1.5) and not heard.take("b", 9, 1.6)     # said again: taken once
    assert heard.to_ask(1.0 + ASK_EVERY) == ({"b": [8]}, {})
    assert heard.take("b", 8, 2.5) and heard.missing() == 0 and heard.lost == 0
    assert not heard.take("b", 10, 3.0)            # an old one said again for another peer


def test_a_hello_names_the_last_word_so_a_lost_last_word_is_missed_too():
    heard = Heard()
    heard.told_last("b", 3, 0.0)
    assert heard.take("b", 4, 0.1)
    heard.told_last("b", 6, 2.0)                   # 5 and 6 went into a link that was cut
    assert heard.to_ask(2.0) == ({"b": [5, 6]}, {})


def test_missing_words_are_given_up_on_after_the_asks_and_when_their_peer_says_goodbye():
    heard = Heard()
    heard.take("b", 1, 0.0)
    heard.take("b", 3, 0.0)
    t = 0.0
    for _ in range(ASK_TRIES):
        assert heard.to_ask(t)[0] == {"b": [2]}
        t += ASK_EVERY
    assert heard.to_ask(t) == ({}, {"b": [2]}) and heard.lost == 1 and heard.missing() == 0
    heard.take("c", 1, t)
    heard.take("c", 4, t)
    assert heard.gone("c") == [2, 3] and heard.lost == 3


def test_a_first_word_said_again_is_not_taken():
    # A newcomer must not take another peer's old words, nor ask for everything before them.
    heard = Heard()
    assert not heard.take("b", 5, 0.0, again=True)
    heard.told_last("b", 50, 0.1)
    assert heard.missing() == 0


def test_what_we_said_is_kept_a_while_to_say_again():
    said = Said(keep=10.0, limit=3)
    for i in range(4):
        said.keep(said.number(), float(i), f"m{i}".encode())
    assert said.again([1, 2, 4], 4.0) == [b"m1", b"m3"]     # the first one pruned by count
    assert said.again([2, 3, 4], 12.5) == [b"m3"]           # and by age
    assert KEEP > HOLD_MAX


def test_a_suspect_waits_until_every_link_has_carried_something_since_it():
    led = CrashLedger(ack_wait=30.0, poison_after=3)
    led.redelivered(10.0, 5, 2)
    assert led.confirm_suspects(12.0, grace=2.0, caught_up=9.9) == []       # a peer unheard since
    assert led.confirm_suspects(12.0 + HOLD_MAX - 0.1, grace=2.0, caught_up=-math.inf) == []
    assert [r.seq for r in led.confirm_suspects(12.0, grace=2.0, caught_up=10.0)] == [5]
    led.redelivered(20.0, 6, 2)
    assert [r.seq for r in led.confirm_suspects(22.0 + HOLD_MAX, grace=2.0, caught_up=-math.inf)] == [6]


def message(body: dict) -> object:
    return type("Msg", (), {"data": json.dumps(body).encode()})


def run(coro) -> None:
    import asyncio
    asyncio.run(coro)


class FakeNats:
    is_connected = True

    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.sent.append(json.loads(data))


def test_a_peers_late_word_explains_a_suspect_held_for_it():
    led = CrashLedger(ack_wait=30.0, poison_after=3)
    nc = FakeNats()
    peers = Peers(nc, "JOBS", "workers", led, post=lambda work: work())
    peers.listening_since = 0.0
    run(peers.on_message(message({"origin": "b", "hello": 1, "last": 3})))
    run(peers.on_message(message({"origin": peers.origin, "hello": 1, "last": 0, "at": 1000})))
    before = peers.caught_up(1e9)
    assert before <= 1.0                            # our own word sent at 1.0 came back: no later
    led.redelivered(before + 0.5, 7, 2)             # seen after: held until the links carried more
    assert led.confirm_suspects(before + 3.0, 2.0, peers.caught_up(1e9)) == []
    run(peers.on_message(message({"origin": "b", "n": 5, "naks": [[9, "x"]]})))     # 4 lost in a cut
    assert peers.caught_up(1e9) == -math.inf        # a word missing: wait for it
    run(peers.flush())
    assert {"origin": peers.origin, "resend": ["b", [4]]}.items() <= nc.sent[-1].items()
    run(peers.on_message(message({"again": 1, "origin": "b", "n": 4, "naks": [[7, "NAKed by a worker at delivery 1"]]})))
    assert led.counts["explained_redeliveries"] == 1 and led.confirm_suspects(1e9, 2.0, -math.inf) == []


def test_a_peer_asking_for_our_words_gets_them_again():
    led = CrashLedger(ack_wait=30.0, poison_after=3)
    nc = FakeNats()
    peers = Peers(nc, "JOBS", "workers", led, post=lambda work: work())
    peers.announce(7, "NAKed by a worker at delivery 1")
    run(peers.flush())
    [said] = [m for m in nc.sent if "naks" in m]
    run(peers.on_message(message({"origin": "b", "resend": [peers.origin, [said["n"]]]})))
    run(peers.on_message(message({"origin": "c", "resend": ["b", [1]]})))     # not ours to say
    nc.sent.clear()
    run(peers.flush())
    assert [m for m in nc.sent if "naks" in m] == [{**said, "again": 1}]


def test_any_word_of_a_peer_names_its_last_number_so_a_gap_shows_before_it_counts_as_heard():
    # Found by the fleet test: after our link was reset, the first word of the peer's we heard
    # was its request for a word of ours it had missed; it moved the peer's last-heard time past
    # the suspect while the peer's own lost word was not known missing yet.
    led = CrashLedger(ack_wait=30.0, poison_after=3)
    peers = Peers(FakeNats(), "JOBS", "workers", led, post=lambda work: work())
    peers.listening_since, peers.echo_sent = 0.0, 1e9
    run(peers.on_message(message({"origin": "b", "hello": 1, "last": 0})))
    run(peers.on_message(message({"origin": "b", "resend": [peers.origin, [1]], "last": 1})))
    assert peers.caught_up(1e9) == -math.inf and peers.asked_again == [1]


def test_a_peers_death_explains_what_was_on_its_wire_here_within_its_credits():
    # F13's second form: the dead worker's own supervisor attributes an AckWait redelivery as in
    # transit at the death; the peer whose worker got it does the same from the death's word, and
    # the credits are spent across both ledgers.
    led_a, led_b = CrashLedger(ack_wait=6.0, poison_after=3), CrashLedger(ack_wait=6.0, poison_after=3)
    a = Peers(FakeNats(), "JOBS", "workers", led_a, post=lambda work: work())
    b = Peers(FakeNats(), "JOBS", "workers", led_b, post=lambda work: work())
    death = led_a.record_death(100.0, 0, 4242, "signal SIGKILL", [], in_transit=2, in_transit_since=99.5)
    a.death(death)
    run(a.flush())
    [said] = [m for m in a.nc.sent if "deaths" in m]
    run(b.on_message(message(said)))
    [copy] = led_b.peer_deaths
    assert copy.in_transit == 2 and copy.key == f"{a.origin}#{death.id}"
    t = copy.t + 6.0
    why = led_b.redelivered(t, 11, 2)
    assert why == f"in transit to worker 0 (pid 4242) at its death (signal SIGKILL) (on {a.origin})"
    run(b.flush())
    [spent] = [m for m in b.nc.sent if "attributed" in m]
    run(a.on_message(message(spent)))
    assert death.attributed == 1
    assert "in transit" in led_a.redelivered(106.0, 12, 2)           # the second credit, spent at A
    run(a.flush())
    run(b.on_message(message([m for m in a.nc.sent if "attributed" in m][-1])))
    assert led_b.redelivered(t + 0.1, 13, 2) == ""                     # none left: a suspect like any other
    assert led_b.redelivered(copy.t + 30.0, 14, 2) == ""               # and none out of its window
