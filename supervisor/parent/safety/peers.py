"""Ledgers shared between supervisors on one consumer.

With a supervisor per host against one cluster, a job that host A NAKs (its dead worker held
it, or its handler failed) may be redelivered to a worker on host B. B's ledger would call that
redelivery unexplained. So every supervisor announces the NAKs it knows of on
`supervisor.ledger.<stream>.<consumer>` (core NATS, a few small messages per crash) and takes
its peers' announcements as expectations. A death is announced before its NAKs are sent, and a
redelivery nothing explains stays a suspect for SUSPECT_GRACE before it counts. Supervisors also
share the redeliveries their workers receive and how those ended, so a job held by host A's dead
worker and redone on host B shows as redelivered and acked in A's cross-check too.

An orphaned worker (workers/runtime/orphan.py) announces its own NAKs here. One on this host
also says when it sent each, with what delay, and, with its goodbye, whether the server had read
them all: the in-transit check can then NAK a redelivery of one that went to a worker of ours
that died before reading it, as it does for its own workers' NAKs (F9, in_transit.py).

A whole host lost (supervisor/parent/tasks/fleet.py) is announced by the fleet's poller, which alone watches
the heartbeats: the jobs the lost supervisor's last heartbeat listed, and a window of time with a
count for the jobs it took after that heartbeat (they come back when their AckWait runs out).

`alone()` decides whether the NAKs built from a sequence alone (supervisor/parent/safety/in_transit.py, the
re-NAK in deaths.py) are safe: they NAK whoever holds the job, a peer's live worker included. A
peer's jobs are held by its workers, on their own connections, while only its parent speaks
here; a parent that is paused, starved, disconnected or half-open goes quiet while its workers
run and even take new jobs. So a peer heard once in this run counts until it says goodbye (after
its workers have exited), however long it has been quiet; our own hellos must come back to us
(a subject we may not publish or subscribe to, a broken link: we could not hear a peer either);
and each supervisor's origin carries a random token (two containers with one hostname, each its
own PID 1, are two peers, not one).

The subject is core NATS: a link fault delays a peer's word (a stall: it waits in the link) or
drops it (a cut, or a stall that ends in a reconnect). F13: a redelivery only a peer's word
explains must not read as unexplained for that. So (a) a suspect is judged only once every link
that could carry its explanation has carried something since (`caught_up`: our own hello sent
after it came back to us, and each peer spoke after it), at most HOLD_MAX (core/ledger.py) past
its grace; and (b) each supervisor numbers what it says (`n`; every message also says the last
number sent), keeps it a while, and says again what a peer asks for (`resend`): a peer that finds
numbers missing asks for them, and holds its suspects until they came or it gave up on them,
warning then that a link fault lost them (supervisor/core/hearing.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from supervisor.core.hearing import Heard, Said
from supervisor.core.ledger import HOLD_MAX, LOST_PEER, Death
from workers.protocol.events import boot_id, ledger_subject

log = logging.getLogger("supervisor.peers")

SUSPECT_GRACE = 2.0     # seconds a peer has to explain a redelivery before it counts as unexplained
CHUNK = 500             # NAKs per announcement
HELLO_EVERY = 2.0       # a supervisor says it exists this often, even with nothing to announce ...
PEER_QUIET = 3 * HELLO_EVERY + 1.0   # ... a peer unheard for this long is gone ...
LISTEN_FIRST = HELLO_EVERY + 1.0     # ... and a fresh supervisor knows whether it is alone after this
SEEN_LIMIT = 100_000    # redeliveries remembered (seq -> highest delivery) for the fleet's release check
BOOT = boot_id()        # an orphan's NAK times are read only from one on this host (one monotonic clock)


class Peers:
    def __init__(self, nc: Any, stream: str, consumer: str, ledger: Any, post: Callable[[Callable[[], None]], None],
                 in_transit: Any = None):
        self.nc = nc
        self.ledger = ledger
        self.in_transit = in_transit             # an orphan's NAKs on this host, and its goodbye, for it
        self.post = post                         # the arbiter applies what we hear, in its loop
        self.subject = ledger_subject(stream, consumer)
        self.origin = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
        # naks: [seq, why] explain a redelivery to come; seen: [seq, delivery] a redelivery one of
        # our workers received; settled: [seq, delivery, outcome] how a redelivered job ended;
        # lost: a lost supervisor's jobs, {"name", "held": [[seq, delivery]], "window": [start, end]
        # seconds from the send, "budget": how many it may have taken after its last heartbeat}.
        # deaths: [id, slot, pid, cause, credits, s since the death, s since it last heard the server] of a worker
        # of ours dead with messages maybe in transit; attributed: ["<origin>#<id>"] a death's credit spent.
        self.outbox: dict[str, list] = {"naks": [], "seen": [], "settled": [], "lost": [], "deaths": [], "attributed": []}
        self.seen_max: OrderedDict[int, int] = OrderedDict()
        self.warned = False
        self.listening_since: float | None = None
        self.last_hello = 0.0
        self.heard: dict[str, float] = {}        # origin -> when we last heard from it
        self.gone: set[str] = set()              # peers that said goodbye: they hold nothing
        self.echo_at: float | None = None        # our own last hello, heard back
        self.echo_sent: float | None = None      # when the last word of ours heard back was sent (caught_up)
        self.said = Said()                       # what we said, numbered, for a peer whose link lost it
        self.words = Heard()                     # which of our peers' numbered words we missed
        self.asked_again: list[int] = []         # numbers of ours a peer missed, to say again at the next flush
        self.sub: Any = None                     # our subscription to the consumer's ledger subject

    async def start(self) -> None:
        try:
            self.sub = await self.nc.subscribe(self.subject, cb=self.on_message)
            self.listening_since = time.monotonic()
            await self._publish(self.hello(ask=True))   # peers: say hello now
        except Exception as exc:
            log.warning("cannot subscribe to %s (%s): redeliveries caused by other supervisors will read as "
                        "unexplained", self.subject, exc)

    def announce(self, seq: int, why: str) -> None:
        self.outbox["naks"].append((seq, why))

    def death(self, death: Any) -> None:
        """A worker of ours died with pull credits outstanding: with a peer on the consumer, what
        was on its wire waits for AckWait and may come back to a peer's worker (F13)."""
        if death.in_transit > 0:
            now = time.monotonic()
            self.outbox["deaths"].append([death.id, death.slot, death.pid, death.cause, death.in_transit,
                                          round(now - death.t, 3), round(now - (death.in_transit_since or death.t), 3)])

    def seen(self, seq: int, delivery: int) -> None:
        self.outbox["seen"].append((seq, delivery))
        self.remember(seq, delivery)

    def remember(self, seq: int, delivery: int) -> None:
        if delivery > self.seen_max.get(seq, 0):
            self.seen_max[seq] = delivery
            self.seen_max.move_to_end(seq)
            while len(self.seen_max) > SEEN_LIMIT:
                self.seen_max.popitem(last=False)

    def seen_delivery(self, seq: int) -> int:
        """The highest delivery of `seq` any supervisor's worker reported receiving (0: none)."""
        return self.seen_max.get(seq, 0)

    def lost_peer(self, name: str, held: list[tuple[int, int]], window: tuple[float, float], budget: int) -> None:
        """The fleet's poller found supervisor `name` lost: explain its jobs here and everywhere."""
        item = {"name": name, "held": [list(h) for h in held], "window": [round(w, 3) for w in window],
                "budget": budget}
        self.outbox["lost"].append(item)
        sent = time.monotonic()             # the window counts from now, not from when the arbiter gets to it
        self.post(lambda: self.apply_lost(sent, item))

    def apply_lost(self, now: float, item: dict) -> None:
        name = item["name"]
        for seq, delivery in item["held"]:
            self.ledger.expect(seq, LOST_PEER + name, delivery)
        start, end = item["window"]
        if item["budget"] > 0:
            self.ledger.expect_window(now + start, now + end, item["budget"],
                                      f"taken by lost supervisor {name} after its last heartbeat")

    def settled(self, seq: int, delivery: int, outcome: str) -> None:
        self.outbox["settled"].append((seq, delivery, outcome))

    def alone(self, now: float) -> bool | None:
        """No other supervisor on this consumer? None while we cannot tell yet (a peer says
        hello every HELLO_EVERY, and answers a newcomer's question at once). A peer once heard
        counts until its goodbye; and we must hear our own hellos, or we could not hear theirs.
        Hellos that stop coming back (our link stalled or down) make it None, not False: we
        heard ourselves before, so once they come back, and LISTEN_FIRST after that (a peer's
        hellos sent meanwhile may be lost to us), we can tell again (F6)."""
        if self.listening_since is None:
            return False                         # deaf to peers: never assume we are alone
        if any(origin not in self.gone for origin in self.heard):
            return False
        if now - self.listening_since < LISTEN_FIRST:
            return None
        if self.echo_at is None:
            return False                         # never heard ourselves: denied, or no echo
        return None if now - self.echo_at > PEER_QUIET else True

    async def goodbye(self) -> None:
        """Our workers have all exited: peers may count us gone."""
        if self.listening_since is not None and self.nc.is_connected:
            await self._publish({"origin": self.origin, "bye": 1})
            try:
                await self.nc.flush(timeout=1)
            except Exception as exc:
                log.debug("goodbye not confirmed: %s", exc)

    async def close(self) -> None:
        """This pool is done here (a reload took it out, or failed after making it): goodbye, so
        that no peer counts it for good (alone() would stay False), and stop listening."""
        await self.goodbye()
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()
            self.sub = None

    def hello(self, ask: bool = False) -> dict:
        """We are here (`encode` adds the last number we said: a peer missing some asks for it)."""
        return {"origin": self.origin, "hello": 1, **({"ask": 1} if ask else {})}

    async def flush(self) -> None:
        now = time.monotonic()
        if now - self.last_hello >= HELLO_EVERY and self.nc.is_connected:
            self.last_hello = now
            await self._publish(self.hello())
        if not self.nc.is_connected:
            return
        self.outbox["attributed"] += [f"{self.origin}#{ref}" if isinstance(ref, int) else ref
                                      for ref in self.ledger.attributions]
        self.ledger.attributions.clear()
        await self.ask_again(now)
        if self.asked_again:
            numbers, self.asked_again = self.asked_again, []
            await self.say_again(numbers)
        if not any(self.outbox.values()):
            return
        batch, self.outbox = self.outbox, {k: [] for k in self.outbox}
        for key, items in batch.items():
            for i in range(0, len(items), CHUNK):
                n = self.said.number()
                data = self.encode({"origin": self.origin, "n": n, key: items[i:i + CHUNK]})
                self.said.keep(n, now, data)
                await self._send(data)

    async def ask_again(self, now: float) -> None:
        """Ask each peer for the words of its we missed (a link fault lost them); say which we
        gave up on: the redeliveries they explained will read as unexplained."""
        asks, given_up = self.words.to_ask(now)
        for origin, numbers in asks.items():
            await self._publish({"origin": self.origin, "resend": [origin, numbers[:CHUNK]]})
        for origin, numbers in given_up.items():
            self.lost_words(origin, numbers, "asked for them again and again")

    def lost_words(self, origin: str, numbers: list[int], how: str) -> None:
        log.warning("%d message(s) of supervisor %s on %s never reached us (a link fault lost them; %s): a "
                    "redelivery only they explained reads as unexplained", len(numbers), origin, self.subject, how,
                    extra={"event": "peer_words_lost", "origin": origin, "count": len(numbers)})

    async def say_again(self, numbers: list[int]) -> None:
        """A peer missed these words of ours: say them again (each peer takes a number once)."""
        for data in self.said.again(numbers, time.monotonic()):
            await self._send(b'{"again":1,' + data[1:])      # not a first word: a newcomer must not take it

    def encode(self, body: dict) -> bytes:
        """A message of ours, with the last number we had said by then (a peer that missed one
        asks for it, whatever word of ours it hears next) and when we sent it: heard back, it
        says our link carried everything routed to us before it (caught_up)."""
        boot = {"boot": BOOT} if "deaths" in body else {}      # a death's times are read on this host only
        body = {**body, "last": self.said.last, "at": int(time.monotonic() * 1000), **boot}   # ms: a fixed size
        return json.dumps(body, separators=(",", ":")).encode()

    async def _publish(self, body: dict) -> None:
        await self._send(self.encode(body))

    async def _send(self, data: bytes) -> None:
        try:
            await self.nc.publish(self.subject, data)
        except Exception as exc:
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        if not self.warned:
            log.warning("cannot announce NAKs on %s: %s", self.subject, exc)
            self.warned = True

    async def on_message(self, msg: Any) -> None:
        try:
            self.receive(json.loads(msg.data))
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("ignoring a malformed ledger message on %s: %r", self.subject, msg.data[:100])

    def receive(self, body: dict, record: bool = False) -> None:
        """A ledger message; `record`: an orphan's record from the fleet bucket (workers/runtime/orphan.py
        leave_record), its NAKs and then its goodbye in one, for a supervisor that was not listening
        when it said them. Raises ValueError, KeyError, TypeError or AttributeError when malformed."""
        origin = str(body["origin"])
        naks = [(int(seq), str(why)) for seq, why in body.get("naks", ())]
        seen = [(int(seq), int(delivery)) for seq, delivery in body.get("seen", ())]
        settled = [(int(seq), int(d), str(outcome)) for seq, d, outcome in body.get("settled", ())]
        lost = [lost_item(item) for item in body.get("lost", ())]
        deaths = [peer_death(origin, item, float(body["at"]) / 1000 if body.get("boot") == BOOT != "" else None)
                  for item in body.get("deaths", ())]
        attributed = [str(ref) for ref in body.get("attributed", ())]
        naked = [(int(seq), int(d), float(at), float(delay), float(held))
                 for seq, d, at, delay, held in body.get("naked", ())] if body.get("boot") == BOOT != "" else []
        if origin == self.origin:
            sent = body.get("at")
            self.post(lambda: self.echoed(None if sent is None else float(sent) / 1000))
            return
        numbered = None if record or body.get("n") is None else int(body["n"])
        last = None if record or body.get("last") is None else int(body["last"])
        again = bool(body.get("again"))
        if "resend" in body:
            target, numbers = str(body["resend"][0]), [int(n) for n in body["resend"][1]]
            if target == self.origin:
                self.post(lambda: self.asked_again.extend(numbers))
            self.post(lambda: self.heard_of(origin, last))      # before apply: a gap known before it counts as heard
            self.post(lambda: self.apply(origin, [], [], []))
            return

        def take() -> None:
            if numbered is not None and not self.words.take(origin, numbered, time.monotonic(), again):
                return                           # said again for another peer: taken already
            if not again:
                self.heard_of(origin, last)
            for death in deaths:
                self.ledger.peer_death(death)
            for ref in attributed:
                mine = ref.startswith(self.origin + "#")
                self.ledger.attributed_elsewhere(int(ref.rsplit("#", 1)[1]) if mine else ref)
            if not body.get("bye") or record:
                self.apply(origin, naks, seen, settled, lost, asked=bool(body.get("ask")))
                if naked and self.in_transit is not None:
                    self.orphan_naked(origin, naked)
            if body.get("bye"):
                self.said_goodbye(origin, bool(body.get("fenced")))
        self.post(take)

    def heard_of(self, origin: str, last: int | None) -> None:
        """Whatever a peer says (but what it says again) names the last number it had said:
        one we never got is known missing before anything heard from it counts (caught_up)."""
        if last is not None:
            self.words.told_last(origin, last, time.monotonic())

    def said_goodbye(self, origin: str, fenced: bool) -> None:
        self.gone.add(origin)
        lost = self.words.gone(origin)
        if lost:
            self.lost_words(origin, lost, "it said goodbye before we could ask")
        if fenced and self.in_transit is not None:
            self.in_transit.naks_read(origin, time.monotonic())

    def orphan_naked(self, origin: str, naked: list[tuple[int, int, float, float, float]]) -> None:
        now = time.monotonic()
        for seq, delivery, at, delay, held_at in naked:
            self.in_transit.worker_nak(seq, delivery, at, delay, held_at, now, by=origin)

    def echoed(self, sent: float | None = None) -> None:
        now = time.monotonic()
        if self.echo_at is not None and now - self.echo_at > PEER_QUIET:
            self.listening_since = now           # deaf for a while: listen afresh before we can tell (alone)
        self.echo_at = now
        if sent is not None:
            self.echo_sent = max(self.echo_sent or 0.0, sent)

    def caught_up(self, now: float) -> float:
        """A redelivery seen before this time has had every word a peer said about it reach us,
        as far as we can tell (F13): a word of ours sent then came back (our link carried what was
        routed to us before it), every peer heard from since (a stalled peer's words come with
        its next; one unheard for HOLD_MAX is not waited for), none of their words missing.
        inf when we cannot hear ourselves at all: there is nothing to wait for."""
        if self.listening_since is None or self.echo_sent is None:
            return math.inf
        if self.words.missing():
            return -math.inf
        live = [t for origin, t in self.heard.items() if origin not in self.gone and now - t < HOLD_MAX]
        return min([self.echo_sent, *live])

    def apply(self, origin: str, naks: list, seen: list, settled: list, lost: Sequence[dict] = (),
              asked: bool = False) -> None:
        now = time.monotonic()
        self.heard[origin] = now
        self.gone.discard(origin)
        if asked:
            self.last_hello = 0.0                # a newcomer asks who is there: hello at the next flush
        for seq, why in naks:
            if self.ledger.expect(seq, f"{why} (on {origin})"):
                log.info("job seq=%d, redelivered here a moment ago, is explained: %s (on %s)", seq, why, origin,
                         extra={"event": "redelivery_explained", "seq": seq, "why": f"{why} (on {origin})"})
        for seq, delivery in seen:
            self.ledger.redelivered_elsewhere(now, seq, delivery)
            self.remember(seq, delivery)
        for item in lost:
            self.apply_lost(now, item)
        for seq, delivery, outcome in settled:
            if outcome in ("ack", "term"):
                self.ledger.settled(now, seq, delivery, outcome)


def peer_death(origin: str, item: list, sent_at: float | None) -> Death:
    """A "deaths" item as a Death in this ledger's clock: from the sender's own monotonic time on
    this host (`sent_at`), else counted back from now (a link's delay makes it later)."""
    death_id, slot, pid, cause, credits, ago, since_ago = item
    now = time.monotonic() if sent_at is None else sent_at
    return Death(0, now - float(ago), int(slot), int(pid), str(cause), [], int(credits),
                 in_transit_since=now - float(since_ago), key=f"{origin}#{int(death_id)}")


def lost_item(item: dict) -> dict:
    """A "lost" announcement checked and typed (ValueError, KeyError or TypeError when malformed)."""
    start, end = item["window"]
    return {"name": str(item["name"]), "held": [(int(seq), int(d)) for seq, d in item["held"]],
            "window": (float(start), float(end)), "budget": int(item["budget"])}
