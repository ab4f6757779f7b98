"""`supervisor dlq list` and `supervisor dlq replay`: the jobs the supervisor gave up on.

A dead letter is a copy of a job in `restart.dead_letter_stream`, written by
`workers.runtime.dead_letter()` when a handler raised Reject, a job reached
`consumer.max_deliver`, or a job was running at `restart.poison_after_crashes` worker deaths.
Its `Supervisor-Dead-Letter-*` headers say where it came from (stream, sequence, subject,
original Nats-Msg-Id), how many deliveries it had and why it was given up on.

Replay publishes a copy to the original subject (or --subject) with the job's own headers,
waits for the PubAck, and only then deletes the dead letter. A crash or a lost connection
between the two leaves the job in both places, and running the replay again must not queue it
twice: the copy's Nats-Msg-Id is derived from the dead letter, so the work stream drops the
second copy as a duplicate (within its `stream.duplicate_window`), says so in the PubAck, and
the dead letter is deleted then. A retry later than the window runs the job twice: at least
once, as everywhere else.

A dead letter names the consumer that gave up on it. Off a work queue, pools whose filters
overlap each get every message (a fan-out), and each may give up on its own copy: the replay
goes back to that consumer's pool alone. The copy carries the consumer's name
(`Supervisor-Consumer`), and the other pools' workers ack it unrun (workers/middleware/copies.py
NotOurs), as they do a copy for later. Only while that consumer exists and takes the subject
the copy goes to (`--subject` too): otherwise it is left unnamed, for every pool on the subject
(said on the replay's line), never for a consumer that would never get it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import uvloop
from nats.js.errors import NotFoundError

from supervisor.cli.oneshot import connect_oneshot, one_line
from supervisor.cli.publish import publish_failure
from supervisor.config import Config, client_config, from_args, subject_matches
from supervisor.errors import EXIT_OK, ConfigError, NatsUnavailable
from workers.middleware.copies import OWNER_HEADER
from workers.runtime.deadletter import DLQ_HEADER

REPLAYED_FROM = "Supervisor-Replayed-From"
REASON_SHOWN = 60           # characters of the reason in the text table


@dataclass
class Letter:
    """One dead letter, as read back from the dead-letter stream."""
    seq: int                         # its sequence in the dead-letter stream: what --seq takes
    time: str                        # when it was dead-lettered (RFC 3339, UTC, from the server)
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def about(self, name: str) -> str | None:
        return self.headers.get(DLQ_HEADER + name)

    @property
    def subject(self) -> str | None:
        return self.about("Subject")

    @property
    def job_seq(self) -> int | None:
        seq = self.about("Sequence")
        return int(seq) if seq and seq.isdigit() else None

    def as_dict(self) -> dict[str, Any]:
        deliveries = self.about("Deliveries")
        return {"seq": self.seq, "time": self.time, "subject": self.subject, "stream": self.about("Stream"),
                "consumer": self.about("Consumer"),
                "stream_seq": self.job_seq, "deliveries": int(deliveries) if deliveries and deliveries.isdigit()
                else None, "reason": self.about("Reason"), "msg_id": self.about("Msg-Id"),
                "data": self.data.decode(errors="replace"), "headers": self.job_headers()}

    def job_headers(self) -> dict[str, str]:
        """The job's own headers: what it was published with, without the dead-letter ones (nor
        the consumer a copy for later was made for: a replay names its own, replay_for)."""
        return {k: v for k, v in self.headers.items()
                if not k.lower().startswith(DLQ_HEADER.lower()) and k.lower() not in ("nats-msg-id",
                                                                                       OWNER_HEADER.lower())}


def replay_id(dlq_stream: str, letter: Letter) -> str:
    """The copy's Nats-Msg-Id: the same for every replay of this dead letter, and different for
    any other one (the job's own stream and sequence guard against a recreated dead-letter
    stream numbering from 1 again)."""
    return f"replay-{dlq_stream}-{letter.seq}-{letter.about('Stream') or ''}-{letter.job_seq or ''}"


def cmd_dlq(args: argparse.Namespace) -> int:
    cfg = client_config(from_args(args))
    if not cfg.restart.dead_letter_stream:
        raise ConfigError("restart.dead_letter_stream", "is empty, so no dead letters are kept (they are only "
                                                        "published to restart.dead_letter_subject)")
    if args.action == "list":
        if args.limit < 1:
            raise ConfigError("--limit", f"must be 1 or more, got {args.limit}")
        return uvloop.run(list_letters(cfg, args.limit, args.json))
    return uvloop.run(replay(cfg, None if args.all else args.seq, args.subject))


# ---------------------------------------------------------------- reading

async def read_letters(js: Any, stream: str, limit: int, upto: int | None = None) -> tuple[list[Letter], int]:
    """Up to `limit` dead letters, oldest first, and how many there are in all."""
    try:
        state = (await js.stream_info(stream)).state
    except NotFoundError:
        return [], 0
    last = state.last_seq if upto is None else min(upto, state.last_seq)
    letters: list[Letter] = []
    seq = state.first_seq
    while seq <= last and len(letters) < limit:
        try:        # the next message at or after seq, on any subject (deleted ones are skipped)
            raw = await js.get_msg(stream, seq, subject=">", next=True)
        except NotFoundError:
            break
        if raw.seq > last:
            break
        letters.append(to_letter(raw))
        seq = raw.seq + 1
    return letters, state.messages


async def read_one(js: Any, stream: str, seq: int) -> Letter:
    try:
        return to_letter(await js.get_msg(stream, seq))
    except NotFoundError:
        raise ConfigError("--seq", f"no dead letter {seq} in {stream} (see `supervisor dlq list`)") from None


def to_letter(raw: Any) -> Letter:
    return Letter(seq=raw.seq, time=str(raw.time or ""), data=raw.data or b"", headers=dict(raw.headers or {}))


# ---------------------------------------------------------------- list

async def list_letters(cfg: Config, limit: int, as_json: bool) -> int:
    stream = cfg.restart.dead_letter_stream
    nc = await connect_oneshot(cfg, "dlq")
    try:
        letters, total = await read_letters(nc.jetstream(), stream, limit)
    finally:
        await nc.close()
    if as_json:
        print(json.dumps([letter.as_dict() for letter in letters], indent=1))
        return EXIT_OK
    if not letters:
        print(f"no dead letters in {stream}")
        return EXIT_OK
    rows = [["seq", "dead-lettered", "subject", "job", "deliveries", "reason"]]
    for letter in letters:
        d = letter.as_dict()
        rows.append([str(letter.seq), local_time(letter.time), d["subject"] or "?",
                     f"{d['stream'] or '?'} seq {d['stream_seq'] or '?'}", str(d["deliveries"] or "?"),
                     one_line(d["reason"] or "", REASON_SHOWN)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(cell.rjust(w) if i in (0, 4) else cell.ljust(w) for i, (cell, w) in
                        enumerate(zip(r, widths))) + "  " + r[-1])
    if total > len(letters):
        print(f"... {total - len(letters)} more in {stream} (--limit)")
    return EXIT_OK


def local_time(stamp: str) -> str:
    """The server's RFC 3339 time (nanoseconds, Z) as local time to the second."""
    head, _, _ = stamp.partition(".")
    try:
        when = datetime.fromisoformat(head.rstrip("Z") + "+00:00")
    except ValueError:
        return stamp or "?"
    return when.astimezone().strftime("%Y-%m-%d %H:%M:%S")


# ---------------------------------------------------------------- replay

async def replay(cfg: Config, seqs: list[int] | None, subject: str | None) -> int:
    """Replay the given dead letters (None: every one there is now, not those that arrive
    meanwhile, e.g. a replayed job rejected again at once)."""
    stream = cfg.restart.dead_letter_stream
    nc = await connect_oneshot(cfg, "dlq replay")
    done = 0
    try:
        js = nc.jetstream()
        if seqs is None:
            letters, _ = await read_letters(js, stream, limit=2**62)
        else:
            letters = [await read_one(js, stream, seq) for seq in dict.fromkeys(seqs)]
        for letter in letters:
            print(await replay_one(js, stream, letter, subject))
            done += 1
    except NatsUnavailable as exc:
        raise NatsUnavailable(f"{exc}; replayed {done} before it") from None
    finally:
        await nc.close()
    print(f"replayed {done} dead letter{'s' if done != 1 else ''} from {stream}")
    return EXIT_OK


async def replay_for(js: Any, letter: Letter, target: str) -> tuple[str, str]:
    """(the consumer the replay is for, "") when the dead letter names one that exists and takes
    `target`; else ("", why it goes to every pool on the subject), "" for a letter naming none."""
    consumer, stream = letter.about("Consumer"), letter.about("Stream")
    if not consumer or not stream:
        return "", ""
    try:
        info = await js.consumer_info(stream, consumer, timeout=5.0)
    except NotFoundError:
        return "", f"consumer {consumer} is gone from {stream}: for every pool on {target}"
    except Exception as exc:
        raise NatsUnavailable(f"dead letter {letter.seq}: cannot read consumer {consumer} "
                              f"({one_line(publish_failure(exc))}); it stays") from None
    filters = [f for f in [info.config.filter_subject, *(info.config.filter_subjects or ())] if f]
    if filters and not any(subject_matches(f, target) for f in filters):
        return "", f"consumer {consumer} does not take {target}: for every pool on it"
    return consumer, ""


async def publish_copy(js: Any, stream: str, letter: Letter, subject: str | None) -> tuple[Any, str]:
    """Step one of a replay: the copy, stored (PubAck) or known to be stored already; and a note
    when it could not be sent back to the consumer that gave up on it alone."""
    target = subject or letter.subject
    if not target:
        raise ConfigError("--subject", f"dead letter {letter.seq} does not say its original subject; pass --subject")
    consumer, note = await replay_for(js, letter, target)
    headers = {**letter.job_headers(), "Nats-Msg-Id": replay_id(stream, letter),
               REPLAYED_FROM: f"{stream}:{letter.seq}", **({OWNER_HEADER: consumer} if consumer else {})}
    try:
        return await js.publish(target, letter.data, headers=headers, timeout=5.0), note
    except Exception as exc:
        raise NatsUnavailable(f"dead letter {letter.seq}: publishing to {target} failed "
                              f"({one_line(publish_failure(exc))}); it stays in {stream}") from None


async def replay_one(js: Any, stream: str, letter: Letter, subject: str | None) -> str:
    ack, note = await publish_copy(js, stream, letter, subject)
    try:
        await js.delete_msg(stream, letter.seq)
    except NotFoundError:
        pass                         # another replay deleted it meanwhile: it is gone, as wanted
    target = subject or letter.subject
    origin = f"{letter.about('Stream') or '?'} seq {letter.job_seq or '?'}"
    if ack.duplicate:
        return (f"dead letter {letter.seq} ({origin}) was already in {ack.stream} as seq {ack.seq} "
                "(an earlier replay was cut short); removed it")
    return f"dead letter {letter.seq} ({origin}) -> {target}: {ack.stream} seq {ack.seq}" + (f" ({note})" if note else "")
