"""[ordering]: what a job's key is, which stream subjects hold the jobs of one key, and the rule
that says when a job of a key may start. Pure (no I/O): the config checks it at load, the worker
(workers/runtime/ordering.py) asks the stream with what it returns.

The mechanism (README "Ordered per key"): the work consumer's stream is a work queue, so a job
stays stored until it is acked or TERMed (or deleted). "The previous job of key K is not done"
is therefore exactly "the stream still stores a job of key K with a lower sequence". A worker
that receives job s of key K asks the stream for the first stored message of K (STREAM.MSG.GET
with `next_by_subj`, from the stream leader) and starts s only if that message IS s. Publishing
appends, so no job of K below s can appear later: once true it stays true, whoever holds what,
through crashes, recycling and lost hosts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

SPEC = re.compile(r"subject:([1-9][0-9]*)")
MAX_TOKEN = 64              # a subject of more tokens than this is not a design anyone needs ordered

START, WAIT, GONE = "start", "wait", "gone"


def token_of(spec: str) -> int | None:
    """`ordering.key` -> the 1-based subject token that is the key; None for "" (unordered).
    ValueError, saying what is expected, for anything else."""
    if spec == "":
        return None
    m = SPEC.fullmatch(spec.strip())
    if m is None or int(m.group(1)) > MAX_TOKEN:
        raise ValueError(f'expected "subject:N" (N = 1..{MAX_TOKEN}, the token of the job\'s subject that is its '
                         f'key) or "" (unordered), got {spec!r}')
    return int(m.group(1))


def key_of(subject: str, n: int) -> str | None:
    """The key of a job on `subject`: its n-th token; None when it has fewer tokens (unordered)."""
    tokens = subject.split(".")
    return tokens[n - 1] if len(tokens) >= n else None


def reaches(pattern: str, n: int) -> bool:
    """Whether a subject matching `pattern` can have an n-th token."""
    tokens = pattern.split(".")
    return len(tokens) >= n or tokens[-1] == ">"


def filters_of(pattern: str, n: int, key: str) -> list[str]:
    """The subject filters that match exactly the subjects matching `pattern` whose n-th token is
    `key` (none when no such subject can exist). Tokens before n keep the pattern's own (a `>`
    there becomes `*`s); token n is the key; after it the pattern's tail. A `>` at or before token
    n matches one token or more, so the key may end the subject or not: two filters, `...key` and
    `...key.>` (one request each; the lower answer wins)."""
    tokens = pattern.split(".")
    wide = next((i for i, t in enumerate(tokens[:n]) if t == ">"), None)
    if wide is not None:
        head = tokens[:wide] + ["*"] * (n - 1 - wide) + [key]
        return [".".join(head), ".".join(head + [">"])]
    if len(tokens) < n or tokens[n - 1] not in ("*", key):
        return []
    return [".".join(tokens[:n - 1] + [key] + tokens[n:])]


def key_filters(patterns: Iterable[str], n: int, key: str) -> tuple[str, ...]:
    """Every filter that holds jobs of `key` among the consumer's `patterns` (its job subjects)."""
    out: list[str] = []
    for pattern in patterns:
        out += [f for f in filters_of(pattern, n, key) if f not in out]
    return tuple(out)


def problems(spec: str, patterns: Iterable[str]) -> list[str]:
    """What is wrong with `ordering.key` for a consumer delivering `patterns` (its job subjects)."""
    try:
        n = token_of(spec)
    except ValueError as exc:
        return [str(exc)]
    if n is None:
        return []
    return [f"token {n} of {p!r}: a subject it matches has {len(p.split('.'))} token(s), so its jobs would have "
            f"no key" for p in patterns if not reaches(p, n)]


def verdict(candidate: int, head: int | None) -> str:
    """The start rule. `head`: the first stored sequence of the candidate's key, read from at or
    below the candidate (None: nothing stored there). START only when it IS the candidate; an
    earlier one is a job of the key not done yet: WAIT. Nothing, or a later one, means the
    candidate itself is gone from the stream (acked, TERMed or deleted elsewhere: a duplicate
    delivery), or a replica has not stored it yet: GONE, never a start."""
    if head == candidate:
        return START
    if head is not None and head < candidate:
        return WAIT
    return GONE
