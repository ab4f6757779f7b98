"""An orphan's claim on its dead parent's fleet heartbeat, and the poller's lost mark it meets.

A supervisor's heartbeat (supervisor/parent/tasks/fleet.py, a KV entry) lists the jobs its workers
hold: `held` as [seq, delivery, AckWait timer age at the beat, reply, state], `t` the beat's wall
time. When the parent dies, the fleet's poller finds the entry silent for 3 heartbeats, writes a
`lost` mark into it (revision-checked) and NAKs ("releases") the jobs it listed. But the parent's
workers live on for ORPHAN_GRACE as orphans (workers/runtime/orphan.py): they run what they
hold, then NAK what still runs. A release while they do hands the job to a second worker, and
the orphan's NAK at the end of its grace matches by stream sequence: it hits that second
delivery, and a third one runs beside it (seed 52).

So an orphan claims its jobs before it NAKs anything: it rewrites the entry, revision-checked,
without the jobs it holds or has NAKed (they are its own to settle; their ages brought up to
now). A poller that read the entry before the claim fails its mark (the revision moved) and
sees a fresh beat: it declares the peer lost only 3 heartbeats after the orphans' last claim,
and releases what none of them claimed. If the mark came first, the claim fails on its
revision, and the orphan reads the mark: it must not NAK what the poller released (the mark
says which; an older poller's mark, without that list, everything listed).

An orphan also leaves its NAKs, and its goodbye, in the fleet bucket at its exit (`orphan_key`):
the supervisor started in its parent's place may not have been listening when it said them on
the ledger subject (a loaded host takes seconds to start one), and without them it cannot tell
that a redelivery of one went to a worker of its own that died before reading it (F9).

Pure functions of the entry's JSON: both sides read this format.
"""

from __future__ import annotations

from collections.abc import Iterable

Job = tuple[int, int]           # (stream seq, delivery)
ORPHAN_PREFIX = "orphan."       # an orphan's record in the fleet bucket (beside the `sup.` heartbeats)


def orphan_key(parent_key: str, token: str) -> str:
    """Where an orphan (`token`) of the supervisor whose heartbeat key is `parent_key` leaves its record."""
    return f"{ORPHAN_PREFIX}{parent_key.partition('.')[2]}.{token}"


def released(beat: dict, consumer: str) -> set[Job] | None:
    """The jobs a poller's lost mark in `beat` released on `consumer` (or may have: every job
    listed when the mark does not say); None when no poller has acted on that consumer (the mark
    names the consumers its pollers acted for: with pools, each consumer has its own poller)."""
    mark = beat.get("lost")
    if not mark:
        return None
    if not isinstance(mark, dict):
        return {(int(s), int(d)) for s, d, *_ in beat.get("held") or []}
    if "consumers" in mark and consumer not in mark["consumers"]:
        return None
    which = mark.get("released")
    if isinstance(which, dict):
        which = which.get(consumer, [])
    return {(int(s), int(d)) for s, d, *_ in (which if which is not None else beat.get("held") or [])}


def claimed(beat: dict, mine: Iterable[Job], now: float, who: str) -> dict:
    """`beat` rewritten by an orphan (`who`) at wall time `now`: without the jobs it holds or
    NAKed (`mine`), the others' timer ages brought up to now, and the orphan named."""
    ours = set(mine)
    ahead = max(0.0, now - float(beat.get("t") or now))
    listed = beat.get("held") or []
    held = [[s, d, round(float(age) + ahead, 3), *rest] for s, d, age, *rest in listed if (int(s), int(d)) not in ours]
    total = max(len(held), int(beat.get("held_total") or len(listed)) - (len(listed) - len(held)))
    return {**beat, "held": held, "held_total": total, "t": now, "orphans": [*(beat.get("orphans") or []), who]}
