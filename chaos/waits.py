"""What the proxy saw clients send decides two things about a late redelivery (chaos/checker.py).

- *A NAK the server had* (`naked`): nats-server's consumer puts a NAKed delivery on its redelivery
  queue at once (a -NAK without delay) or when its delay runs out (processNak sets the pending
  timestamp to now - AckWait + delay), and from there it goes to the next pull request: no
  AckWait runs out for it any more. So a job whose delivery was NAKed before the server sent the
  next one did not wait for an AckWait expiry, whatever kept workers from pulling meanwhile (a
  successor still starting, its link cut, the server away: what the queueing note and the rig's
  stalled check watch, not the AckWait verdict). Two exceptions leave it an AckWait wait: a +WPI
  the server got after the NAK and before its delay ran out (progressUpdate sets the timestamp
  to now: a whole AckWait again, "a +WPI after its NAK", the race of a parent's +WPI landing
  after a worker's NAK with a delay), and a server SIGKILL after the NAK when the job came back
  no sooner than an expiry could have brought it: the restarted server may have lost the NAK
  (its redelivery queue lives in memory; seed 604: a NAK at +38.69 s, the server SIGKILLed at
  +39.57 s, the job back at +51.69 s, AckWait after the parent's last +WPI at +36.80 s). That
  wait is the SIGKILL's, outside the supervisor's control: the NAK had gone. The server applies
  a settle to the sequence's pending delivery whichever delivery its reply subject names (the
  parent's in-transit NAKs name delivery 1), so settles are matched by job and time: after the
  delivery was sent, before the next one was.
- *A delivery that reached no connection* (`lost_in_closing`): the server counted it (the next
  delivery's number says so) and the proxy never read it: it was sent into a pull request of a
  connection as that connection closed. Nobody knew of it, so nothing sent a +WPI or a NAK and
  it came back exactly by AckWait: sent at the redelivery less AckWait, or a little before (the
  redelivery goes to the next pull request after the expiry; seed 849, twice: the connection
  closed 0.66 s and 0.55 s before the handler's start less AckWait). The candidates are the
  connections that closed from LOST_BEFORE before that mark to EXPIRY_SLACK after it (the
  proxy may read a send a moment late) with a pull request of the job's consumer outstanding:
  unexpired, and asking for more than the proxy carried to it since it was sent. What closed
  each is the fault that acted on it at its close: on its connection (a cut, a reset), its
  process (a kill: its socket closes with it), its supervisor, or the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .facts import Fault, Handout, Life, Link, Pull, Settle


class Evidence(Protocol):
    """What these rules read of chaos/checker.py Evidence."""
    faults: list[Fault]
    ack_wait: float
    origin: float
    lives: dict[int, Life]
    handouts: list[Handout]
    settles: list[Settle]
    pulls: list[Pull]
    links: list[Link]

SLACK = 0.05                # seconds: times from different processes (checker.SLACK)
EXPIRY_SLACK = 0.5          # an expiry's redelivery reaches a handler this much after AckWait at most
# A lost delivery's connection closed at most this long before the redelivery less AckWait (seed
# 849: 0.66 s and 0.55 s; with 2 s, a worker retired by a scale-down 1.8 s before, closing as its
# last pull request expired, as its drain does, was a candidate too).
LOST_BEFORE = 1.0
CLOSE_CAUSE = 0.5           # a fault this long before a close can have caused it (a kill: the socket closes after)


@dataclass(frozen=True)
class Naked:
    """The NAK the server had of a delivery before it sent the next one, and a +WPI that undid it."""
    nak: Settle
    wpi: Settle | None = None
    lost_by: Fault | None = None    # a server SIGKILL after it that may have lost it

    def said(self, origin: float) -> str:
        if self.lost_by is not None:
            return (f"the server had its NAK ({self.nak.said(origin)}) and may have lost it: "
                    f"{self.lost_by.name(origin)}")
        if self.wpi is None:
            due = self.nak.t + self.nak.delay
            return f"the server had its NAK: {self.nak.said(origin)}, due +{due - origin:.2f}s"
        return (f"a +WPI after its NAK: {self.nak.said(origin)}, then {self.wpi.said(origin)} before its delay "
                "ran out (a whole AckWait again)")


def naked(ev: Evidence, seq: int, consumer: str, sent: float, next_sent: float, came: float | None,
          back: float) -> Naked | None:
    """The last NAK of job `seq` the proxy carried to the server after its delivery was sent
    (`sent`: a lower bound) and before the next one was (`next_sent`), with a +WPI that came
    after it while its delay had not run out, or the server SIGKILL after it that may have lost it
    when the job came back (`back`) no sooner than an expiry of the delivery (handed out at
    `came`; None: not known) could have brought it; None without one."""
    last: Naked | None = None
    for s in sorted(ev.settles, key=lambda s: s.t):
        if s.seq != seq or (consumer and s.consumer != consumer) or not sent <= s.t <= next_sent:
            continue
        if s.kind == "-NAK":
            last = Naked(s)
        elif s.kind == "+WPI" and last is not None and last.wpi is None and last.nak.delay > 0 \
                and s.t < last.nak.t + last.nak.delay + EXPIRY_SLACK:   # to the redelivery queue a little late
            last = Naked(last.nak, s)
    if last is None or last.wpi is not None:
        return last
    kills = [f for f in ev.faults if f.kind.startswith("nats-server SIGKILL") and last.nak.t - SLACK <= f.t0 <= back]
    if kills and (came is None or back >= came + ev.ack_wait - EXPIRY_SLACK):
        return Naked(last.nak, lost_by=kills[0])
    return last


def first_pull(ev: Evidence, consumer: str, after: float) -> Pull | None:
    """The first pull request of `consumer` the proxy carried after `after`."""
    return min((p for p in ev.pulls if p.t >= after and (not consumer or p.consumer == consumer)),
               key=lambda p: p.t, default=None)


def lost_in_closing(ev: Evidence, consumer: str, back: float) -> list[tuple[Link, list[Fault]]]:
    """The connections a delivery the proxy never read can have been lost to, each with the
    faults that closed it (module doc), for a redelivery the server sent at `back` (or by then)."""
    mark = back - ev.ack_wait
    out = []
    for link in ev.links:
        if link.closed is None or not mark - LOST_BEFORE <= link.closed <= mark + EXPIRY_SLACK:
            continue
        if outstanding(ev, link, consumer):
            out.append((link, closed_by(ev, link)))
    return out


def outstanding(ev: Evidence, link: Link, consumer: str) -> bool:
    """Had the connection a pull request of `consumer` waiting when it closed? The server fills
    a connection's waiting requests oldest first and drops expired ones: replayed here from the
    requests and deliveries the proxy carried on it (seed 52: a worker asking one job at a time,
    its three live requests' worth of deliveries filling older ones)."""
    at = link.closed if link.closed is not None else float("inf")
    events = [(p.t, 1, p.t + p.life(), p.batch) for p in ev.pulls
              if p.conn == link.conn and (not consumer or p.consumer == consumer) and p.t <= at + SLACK]
    events += [(h.came, 0, 0.0, 0) for h in ev.handouts
               if h.conn == link.conn and (not consumer or h.consumer == consumer) and h.came <= at + SLACK]
    waiting: list[list[float]] = []                    # [expiry, messages still asked for], oldest first
    for t, is_pull, expiry, batch in sorted(events):
        if is_pull:
            waiting.append([expiry, batch])
            continue
        waiting = [w for w in waiting if w[0] >= t - SLACK and w[1] > 0]
        if waiting:
            waiting[0][1] -= 1
    return any(w[0] >= at - SLACK and w[1] > 0 for w in waiting)


def closed_by(ev: Evidence, link: Link) -> list[Fault]:
    """The faults that acted on the connection, its process or its supervisor, or on the server,
    at its close (from CLOSE_CAUSE before it)."""
    assert link.closed is not None
    life = ev.lives.get(link.pid)
    parent = life.parent if life is not None and life.parent else (link.ppid if link.ppid > 1 else None)
    as_held = Handout(link.name, "", 0, 0, link.closed, None, link.pid, link.conn, link.ppid)
    died = life.died if life is not None else None
    return [f for f in ev.faults if f.holds(as_held, parent, link.closed - CLOSE_CAUSE, link.closed + SLACK,
                                            None if died is None else died + SLACK)]


def lost_text(ev: Evidence, delivery: int, lost: list[tuple[Link, list[Fault]]]) -> str:
    """For a verdict: where delivery `delivery`, which no connection read, can have gone."""
    def one(link: Link, faults: list[Fault]) -> str:
        assert link.closed is not None
        by = "; ".join(f.name(ev.origin) for f in faults[:3]) or "no fault"
        return (f"#{link.conn} {link.name!r} (pid {link.pid}) closed +{link.closed - ev.origin:.2f}s by "
                f"{link.how or '?'} with a pull request outstanding, closed by: {by}")
    return (f"delivery {delivery} reached no connection (the proxy never read it): sent into a closing one, "
            + " | ".join(one(link, faults) for link, faults in lost))


def nak_lost_in_close(ev: Evidence, seq: int, pid: int, raised: float, conns: set[int], until: float) -> str:
    """How a retry's NAK died with its connection, or "": the handler raised (its R line, at
    `raised`: the worker NAKs at once) and the proxy carried no NAK of the job to the server by
    `until` (the next delivery), while the connection the delivery came on (`conns`) had been
    closed, before the raise, by faults all outside the supervisor's control (a server kill: seed
    962, the worker SIGSTOPped across it, resumed and wrote its NAK into the socket the server had
    closed; nats-py does not send a NAK again on the new connection, which the README says waits
    for AckWait)."""
    if any(s.seq == seq and s.kind == "-NAK" and raised - SLACK <= s.t <= until for s in ev.settles):
        return ""
    for link in ev.links:
        if link.conn in conns and link.pid == pid and link.closed is not None and link.closed <= raised + SLACK:
            # What closed the link itself (the server's faults, or a rule on that connection), not
            # what else acted on its process then (the SIGSTOP that kept it from noticing).
            faults = [f for f in closed_by(ev, link) if f.pids is None or link.conn in f.conns]
            if faults and all(not f.in_control for f in faults):
                return (f"its retry's NAK (the handler raised +{raised - ev.origin:.2f}s) never reached the server: "
                        f"its connection #{link.conn} had been closed +{link.closed - ev.origin:.2f}s by "
                        + "; ".join(f.name(ev.origin) for f in faults[:2]))
    return ""

