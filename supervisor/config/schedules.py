"""NATS message schedules (nats-server 2.12+, ADR-51) as both sides of the supervisor use them:
where a schedule message lives in the stream, the headers that make it one, the patterns
(`@at`, `@every`, cron) checked the way the server parses them, and the plan that makes the
server's config-made schedules match `[schedules.NAME]`. Pure: no NATS here (supervisor/nats/
schedules.py talks to the server; workers/runtime may import this for its re-publish too).

Why a subject space of its own: a schedule is itself a message in the stream, the latest one on
its subject (the server adds a subject rollup). A consumer that matched it would deliver the
schedule as a job, and on a work queue its ack would delete the schedule. So schedules live under
`_sched.<STREAM>.` and the work consumer filters on the job subjects only (nats/provision.py):
a work-queue stream keeps what no consumer matches.

    _sched.<STREAM>.config.<NAME>   made by `start` from [schedules.NAME]; reconciled at each start
    _sched.<STREAM>.cli.<NAME>      made by `supervisor schedule add`; start leaves it alone
    _sched.<STREAM>.at.<TOKEN>      one delayed job (`publish --delay/--at`); the server purges it
                                    once the job is stored
"""

from __future__ import annotations

import calendar
import datetime as dt
import hashlib
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from supervisor.config.subjects import subject_matches, valid_subject

ROOT = "_sched"
CONFIG, CLI, AT = "config", "cli", "at"
NAMED_KINDS = (CONFIG, CLI)

# Headers the server reads (nats-server stream.go); nats-py 2.16 only names them.
PATTERN = "Nats-Schedule"
TARGET = "Nats-Schedule-Target"
SCHEDULER = "Nats-Scheduler"          # on each fired job: the subject of the schedule that made it
NEXT = "Nats-Schedule-Next"           # on each fired job: the next firing, or "purge" after an @at
EXPECT_LAST = "Nats-Expected-Last-Subject-Sequence"
# What the server adds to a stored schedule, or we add to a publish: not part of what it is.
NOT_OURS = ("Nats-Rollup", "Nats-Msg-Id", EXPECT_LAST)

MIN_EVERY = 1.0                        # the server refuses shorter @every periods
MACROS = {"@yearly": "0 0 0 1 1 *", "@annually": "0 0 0 1 1 *", "@monthly": "0 0 0 1 * *",
          "@weekly": "0 0 0 * * 0", "@daily": "0 0 0 * * *", "@midnight": "0 0 0 * * *", "@hourly": "0 0 * * * *"}
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
TOKEN_OK = re.compile(r"[A-Za-z0-9_-]{1,64}")


def space(stream: str) -> str:
    return f"{ROOT}.{stream}"


def space_filter(stream: str) -> str:
    """The subject the stream must capture for schedules (and no consumer may)."""
    return f"{space(stream)}.>"


def named_subject(stream: str, kind: str, name: str) -> str:
    return f"{space(stream)}.{kind}.{name}"


def delayed_subject(stream: str, key: str | None = None) -> str:
    """One delayed job's schedule subject. The same key (a Nats-Msg-Id) gives the same subject,
    so publishing it again before it fires replaces it rather than adding a second."""
    if key is None:
        token = uuid.uuid4().hex
    elif TOKEN_OK.fullmatch(key):
        token = key
    else:
        token = hashlib.sha256(key.encode()).hexdigest()[:40]
    return f"{space(stream)}.{AT}.{token}"


def parse_subject(stream: str, subject: str) -> tuple[str, str] | None:
    """(kind, name) of a schedule subject of this stream, None for any other subject."""
    prefix = space(stream) + "."
    if not subject.startswith(prefix):
        return None
    kind, _, name = subject[len(prefix):].partition(".")
    return (kind, name) if name else None


def in_space(subject: str) -> bool:
    return subject == ROOT or subject.startswith(ROOT + ".")


def job_filters(filter_subject: str, stream_subjects: Iterable[str], schedules_in_stream: bool) -> tuple[str, ...]:
    """The subjects the work consumer delivers: its filter, else every job subject of the stream
    (its subjects but the schedule space) once that space is there; () means all of them."""
    if filter_subject:
        return (filter_subject,)
    if schedules_in_stream:
        return tuple(s for s in stream_subjects if not in_space(s))
    return ()


def job_subjects(cfg: Any) -> tuple[str, ...]:
    """The job subjects as the config names them (the consumer's filter, else the stream's
    subjects): what the parent's searches of the stream look at, never the schedule space."""
    return job_filters(cfg.consumer.filter_subject, cfg.stream.subjects, True)


# ---------------------------------------------------------------- patterns

def every_pattern(seconds: float) -> str:
    """`@every` with a Go duration the server parses (whole milliseconds)."""
    ms = round(seconds * 1000)
    return f"@every {ms // 1000}s" if ms % 1000 == 0 else f"@every {ms}ms"


def every_problem(seconds: float) -> str | None:
    if seconds <= 0:
        return f"must be more than 0 seconds, got {seconds:g}"
    if seconds < MIN_EVERY:
        return f"must be at least {MIN_EVERY:g} second (the server's shortest period), got {seconds:g}"
    return None


def at_pattern(when: dt.datetime) -> str:
    """`@at` in RFC 3339, UTC, to the millisecond (the server takes fractions)."""
    return "@at " + when.astimezone(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_at(text: str) -> dt.datetime:
    """An RFC 3339 time with its offset (`2026-12-01T09:30:00Z`, `...+01:00`); ValueError says why."""
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"expected an RFC 3339 time like 2026-12-01T09:30:00Z, got {text!r}") from None
    if when.tzinfo is None:
        raise ValueError(f"{text!r} has no UTC offset: add Z (UTC) or one like +01:00")
    return when


@dataclass(frozen=True)
class Bounds:
    lo: int
    hi: int
    names: Mapping[str, int] = field(default_factory=dict)


MONTHS = {m.lower(): i for i, m in enumerate(calendar.month_abbr) if m}
DAYS = {d.lower(): (i + 1) % 7 for i, d in enumerate(calendar.day_abbr)}      # sun = 0, as the server
FIELDS = (Bounds(0, 59), Bounds(0, 59), Bounds(0, 23), Bounds(1, 31), Bounds(1, 12, MONTHS), Bounds(0, 6, DAYS))
STAR = -1                               # marks a field written with * or ?, as the server's starBit


def cron_pattern(expr: str) -> str:
    """What the server gets: a 5-field crontab line gets a 0 seconds field in front; 6 fields
    (seconds first) and the @hourly-style macros go as they are."""
    fields = expr.split()
    return "0 " + " ".join(fields) if len(fields) == 5 else " ".join(fields)


def parse_cron(expr: str) -> list[set[int]]:
    """Each field's values (seconds first; a field written with * also holds STAR), parsed as
    nats-server's cron.go does; ValueError names the field and what is wrong."""
    text = expr.strip()
    pattern = MACROS.get(text, cron_pattern(text))
    fields = pattern.split()
    if len(fields) != 6:
        raise ValueError(f"expected 5 fields (minute hour day month weekday, UTC) or 6 (seconds first), "
                         f"got {expr!r}")
    names = ("seconds", "minutes", "hours", "day of month", "month", "day of week")
    out = []
    for name, spec, bounds in zip(names, fields, FIELDS):
        values: set[int] = set()
        for part in (p for p in spec.split(",") if p):
            try:
                values |= _cron_range(part, bounds)
            except ValueError as exc:
                raise ValueError(f"{name} field {spec!r}: {exc}") from None
        if not values - {STAR}:
            raise ValueError(f"{name} field {spec!r} is empty")
        out.append(values)
    if cron_next(out, dt.datetime.now(dt.UTC)) is None:
        raise ValueError(f"{expr!r} never fires (no such day within five years)")
    return out


def _cron_range(expr: str, b: Bounds) -> set[int]:
    range_step = expr.split("/")
    if len(range_step) > 2:
        raise ValueError(f"too many slashes in {expr!r}")
    low_high = range_step[0].split("-")
    star = low_high[0] in ("*", "?")
    if star:
        start, end = b.lo, b.hi
    elif len(low_high) > 2:
        raise ValueError(f"too many hyphens in {expr!r}")
    else:
        start = _cron_int(low_high[0], b)
        end = _cron_int(low_high[1], b) if len(low_high) == 2 else start
    step = 1
    if len(range_step) == 2:
        step = _cron_int(range_step[1], Bounds(0, 1 << 31))
        if len(low_high) == 1:
            end = b.hi                          # "N/step" means "N-max/step"
    if start < b.lo or end > b.hi:
        raise ValueError(f"{expr!r} is outside {b.lo}-{b.hi}")
    if start > end:
        raise ValueError(f"{expr!r} starts after it ends")
    if step == 0:
        raise ValueError(f"step 0 in {expr!r}")
    values = set(range(start, end + 1, step))
    return values | {STAR} if star and step == 1 else values


def _cron_int(text: str, b: Bounds) -> int:
    if text.lower() in b.names:
        return b.names[text.lower()]
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a number" + (f" or a name ({', '.join(b.names)})" if b.names else ""))
    return int(text)


def cron_next(fields: list[set[int]], after: dt.datetime) -> dt.datetime | None:
    """The first second after `after` (UTC) the fields match, within five years, as the server
    finds it (day of month and day of week: both must match if either was written *, else either)."""
    sec, minute, hour, dom, month, dow = fields
    either = STAR not in dom and STAR not in dow
    t = after.astimezone(dt.UTC).replace(microsecond=0) + dt.timedelta(seconds=1)
    day = t.replace(hour=0, minute=0, second=0)
    for _ in range(366 * 5 + 2):
        wd = (day.weekday() + 1) % 7
        d_ok, w_ok = day.day in dom, wd in dow
        if day.month in month and (d_ok or w_ok if either else d_ok and w_ok):
            first = t if day.date() == t.date() else day
            for h in sorted(x for x in hour if x >= 0):
                for m in sorted(x for x in minute if x >= 0):
                    for s in sorted(x for x in sec if x >= 0):
                        candidate = day.replace(hour=h, minute=m, second=s)
                        if candidate >= first:
                            return candidate
        day += dt.timedelta(days=1)
    return None


# ---------------------------------------------------------------- the schedule message

def parse_header(text: str) -> tuple[str, str]:
    """`Name: value` -> (name, value); ValueError says why (Nats-* are the server's)."""
    name, sep, value = text.partition(":")
    name = name.strip()
    if not sep or not HEADER_NAME.fullmatch(name):
        raise ValueError(f"expected \"Name: value\", got {text!r}")
    if name.lower().startswith("nats-"):
        raise ValueError(f"{name} is a NATS header the server acts on; use a name of your own")
    if "\r" in value or "\n" in value:
        raise ValueError(f"{name}: a header value cannot hold a line break")
    return name, value.strip()


@dataclass(frozen=True)
class ScheduleMsg:
    """A schedule as a message: where it lives, when it fires, what each firing publishes."""

    subject: str
    pattern: str
    target: str
    data: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()

    def publish_headers(self) -> dict[str, str]:
        return {**dict(self.headers), PATTERN: self.pattern, TARGET: self.target}

    @classmethod
    def stored(cls, subject: str, headers: Mapping[str, str] | None, data: bytes | None) -> ScheduleMsg:
        h = dict(headers or {})
        user = tuple(sorted((k, v) for k, v in h.items()
                            if k not in (PATTERN, TARGET, *NOT_OURS) and not k.startswith("Nats-Expected-")))
        return cls(subject, h.get(PATTERN, ""), h.get(TARGET, ""), data or b"", user)

    def when(self) -> str:
        """The pattern as a person reads it: `every 5s`, `cron 0 */5 * * * *`, `at ...`."""
        kind, _, rest = self.pattern.partition(" ")
        return f"{kind[1:]} {rest}" if kind in ("@every", "@at") else f"cron {self.pattern}"


def named(stream: str, kind: str, name: str, *, every: float, cron: str, target: str, data: str,
          headers: Iterable[str]) -> ScheduleMsg:
    """A named schedule's message (the values already checked by entry_problems)."""
    pattern = every_pattern(every) if every else MACROS.get(cron.strip(), cron_pattern(cron))
    pairs = tuple(sorted(parse_header(h) for h in headers))
    return ScheduleMsg(named_subject(stream, kind, name), pattern, target, data.encode(), pairs)


def entry_problems(*, every: float, cron: str, subject: str, headers: Iterable[str],
                   stream_subjects: Iterable[str]) -> list[tuple[str, str]]:
    """(field, problem) for one named schedule: the config names them schedules.NAME.<field>,
    `schedule add` its flags."""
    out = []
    if every and cron:
        out.append(("cron", "set every or cron, not both"))
    elif not every and not cron:
        out.append(("every", "needs every = SECONDS (at least 1) or cron = \"MIN HOUR DAY MONTH WEEKDAY\""))
    elif every and (problem := every_problem(every)):
        out.append(("every", problem))
    elif cron:
        try:
            parse_cron(cron)
        except ValueError as exc:
            out.append(("cron", str(exc)))
    patterns = list(stream_subjects)
    if subject and not valid_subject(subject, wildcards=False):
        out.append(("subject", f"{subject!r} must be a plain subject (no spaces, no wildcards)"))
    elif subject and (in_space(subject) or not any(subject_matches(p, subject) for p in patterns)):
        out.append(("subject", f"{subject!r} is not a job subject of the stream (stream.subjects: {', '.join(patterns)})"))
    for h in headers:
        try:
            parse_header(h)
        except ValueError as exc:
            out.append(("headers", str(exc)))
    return out


# ---------------------------------------------------------------- start's plan

@dataclass(frozen=True)
class Plan:
    """What `start` does so the server's config-made schedules are the config's."""

    add: tuple[ScheduleMsg, ...] = ()
    change: tuple[tuple[ScheduleMsg, int], ...] = ()      # with the stored one's sequence (compare-and-set)
    remove: tuple[str, ...] = ()                           # subjects
    keep: tuple[str, ...] = ()                             # names already as the config says
    shadowed: tuple[str, ...] = ()                         # names `schedule add` also made: both fire

    @property
    def changes_anything(self) -> bool:
        return bool(self.add or self.change or self.remove)


def plan(stream: str, wanted: Iterable[ScheduleMsg], stored: Mapping[str, tuple[ScheduleMsg, int]]) -> Plan:
    """`stored`: subject -> (message, sequence) of every named schedule the server holds."""
    want = {m.subject: m for m in wanted}
    add, change, keep = [], [], []
    for subject, msg in sorted(want.items()):
        have = stored.get(subject)
        if have is None:
            add.append(msg)
        elif have[0] != msg:
            change.append((msg, have[1]))
        else:
            keep.append(subject.rpartition(".")[2])
    made = {s: parse_subject(stream, s) or ("", "") for s in stored}
    ours = sorted(s for s, (kind, _) in made.items() if kind == CONFIG and s not in want)
    by_hand = {name for kind, name in made.values() if kind == CLI}
    config_names = {s.rpartition(".")[2] for s in want}
    return Plan(tuple(add), tuple(change), tuple(ours), tuple(keep), tuple(sorted(by_hand & config_names)))
