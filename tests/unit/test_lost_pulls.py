"""Unit tests for when a worker gives up a pull request the server may have forgotten
(workers/runtime/puller.py `Puller.answered` / `expire_lost_pull`, F7 in docs/RELIABILITY.md).

Every time is passed in: the liveness PING's send time and when its PONG came. The request's
own times are set as `Puller.request` sets them.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from workers.protocol.slots import SlotTable
from workers.runtime.puller import PULL_EXPIRES, PULL_MARGIN, STALL, Puller
from workers.runtime.pulls import PullSizer

T = 1000.0          # the request went out
RTT = 0.002         # a quick round trip
LIFE = PULL_EXPIRES + PULL_MARGIN


def puller_with_a_request(credits: int = 2) -> Puller:
    owner = SimpleNamespace(table=SlotTable(8, 64), wake_pull=asyncio.Event(), changed=asyncio.Event())
    p = Puller(owner, 0, PullSizer(2, 2, 100), 0, "$JS.API.CONSUMER.MSG.NEXT.S.C")
    p.credits, p.last_sent, p.pull_deadline = credits, T, T + PULL_EXPIRES
    owner.table.set_credits(credits)
    return p


def pings(p: Puller, first: float, last: float, rtt: float = RTT, every: float = 0.25) -> None:
    """The liveness check, a PING every `every` seconds from `first` to `last`, each answered in `rtt`."""
    t = first
    while t <= last:
        p.answered(t, t + rtt)
        t += every


def test_a_request_read_and_answered_quickly_is_given_up_a_life_after_it_was_read():
    p = puller_with_a_request()
    pings(p, T + 0.1, T + 0.1 + LIFE - 0.05)          # read by T + 0.1: not over before T + 0.1 + LIFE
    assert p.credits == 2 and not p.owner.wake_pull.is_set()
    p.answered(T + 0.1 + LIFE + 0.2, T + 0.1 + LIFE + 0.2 + RTT)
    assert p.credits == 0 and p.owner.table.header(7) == 0 and p.owner.wake_pull.is_set()


def test_a_request_never_read_keeps_its_credits():
    p = puller_with_a_request()
    pings(p, T - 1.0, T - 0.01)                         # every PING left before the request: none proves it read
    p.answered(T - 0.01, T + 10.0)                      # ... however late its PONG came
    assert p.credits == 2


def test_a_stall_after_the_request_was_read_keeps_the_credits_until_a_life_after_it_ended():
    """F7's second form: the server reads R1, then stops (or the link stalls) for 3.5 s; its 408,
    or what it had filled into R1, comes only after. Given up inside the stall, R1's 408 took its
    unfilled count from the next request's credits."""
    p = puller_with_a_request()
    pings(p, T + 0.1, T + 0.3)                          # read before the stall
    p.unanswered()                                      # a PING sent at T + 0.55 times out at T + 2.55
    p.answered(T + 2.8, T + 4.0)                        # a slow one: the stall ends by T + 4.0
    pings(p, T + 4.25, T + 4.0 + LIFE - 0.05)           # quick again, but within a request's life of that
    assert p.credits == 2 and p.stalled is False and p.resumed == T + 4.25 + RTT
    p.answered(T + 4.25 + LIFE + 0.25, T + 4.25 + LIFE + 0.25 + RTT)
    assert p.credits == 0


def test_an_unanswered_ping_is_a_stall_even_if_the_next_is_quick():
    """The server resumed just before the next PING: that one is quick, but what the server had
    for R1 (its 408 from an expiry timer, fills in its queues) may still follow its PONG."""
    p = puller_with_a_request()
    pings(p, T + 0.1, T + 0.3)
    p.unanswered()                                      # sent at T + 0.55, timed out at T + 2.55
    pings(p, T + 2.8, T + 2.8 + LIFE - 0.05)
    assert p.credits == 2
    p.answered(T + 2.8 + LIFE + 0.25, T + 2.8 + LIFE + 0.25 + RTT)
    assert p.credits == 0


def test_a_slow_answer_alone_is_a_stall():
    p = puller_with_a_request()
    pings(p, T + 0.1, T + 1.0)
    p.answered(T + 1.2, T + 1.2 + STALL + 0.1)          # slower than the quickest lately by more than STALL
    assert p.stalled
    pings(p, T + 2.0, T + 2.0 + LIFE - 0.05)            # past the request's end, not past the stall's by a life
    assert p.credits == 2
    p.answered(T + 2.0 + LIFE + 0.25, T + 2.0 + LIFE + 0.25 + RTT)
    assert p.credits == 0


def test_a_link_slow_every_time_is_no_stall():
    """A link whose round trip is long but steady (0.8 s) must still give a lost request up,
    or the worker would stop pulling for good after a server restart."""
    p = puller_with_a_request()
    pings(p, T + 0.1, T + 0.1 + LIFE + 2.5, rtt=0.8, every=0.8 + 0.25)
    assert p.credits == 0


def test_a_reconnect_starts_afresh_on_the_new_links_round_trip():
    """Old requests may still deliver on the new connection (R8): a life after its first answer.
    The new link's round trip (here 0.8 s, to another server) is its own, not a stall."""
    p = puller_with_a_request()
    pings(p, T + 0.1, T + 0.3)
    p.reconnected(T + 0.5)
    first_answer = T + 0.6 + 0.8
    pings(p, T + 0.6, first_answer + LIFE - 0.05, rtt=0.8, every=1.05)
    assert p.credits == 2
    p.answered(first_answer + LIFE + 0.1, first_answer + LIFE + 0.9)
    assert p.credits == 0
