"""NATS subject grammar and HOST:PORT, as the config checks them."""

from __future__ import annotations

from supervisor.errors import ConfigError


def valid_subject(subject: str, wildcards: bool) -> bool:
    tokens = subject.split(".")
    if not subject or any(not t or any(c.isspace() for c in t) for t in tokens):
        return False
    if not wildcards and any(t in ("*", ">") for t in tokens):
        return False
    return ">" not in tokens[:-1]


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, `>` the rest."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def subjects_overlap(a: str, b: str) -> bool:
    """Can one subject match both patterns? (Two pools' filters on one work-queue stream must not
    overlap: the server hands a message to one consumer only, and refuses the second.)"""
    p, q = a.split("."), b.split(".")
    for x, y in zip(p, q):
        if x == ">" or y == ">":
            return True          # each side still has a token here: `>` takes it and the rest
        if x != y and "*" not in (x, y):
            return False
    return len(p) == len(q)


def overlap_example(a: str, b: str) -> str:
    """A subject two overlapping patterns both match, to show in an error."""
    p, q = a.split("."), b.split(".")
    out: list[str] = []
    for i, (x, y) in enumerate(zip(p, q)):
        if ">" in (x, y):
            rest = q[i:] if x == ">" else p[i:]
            return ".".join(out + ["x" if t in ("*", ">") else t for t in rest])
        out.append(y if x == "*" else x if x != "*" or y != "*" else "x")
    return ".".join("x" if t == "*" else t for t in out)


def parse_hostport(text: str, name: str, source: str = "") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(name, f"expected HOST:PORT, got {text!r}", source)
    return host.strip("[]") or "127.0.0.1", int(port)


def default_subject(stream_subjects: tuple[str, ...]) -> str:
    """A plain subject inside the stream's first pattern: `jobs.>` -> `jobs.new`, `a.*` -> `a.any`."""
    return ".".join("new" if t == ">" else "any" if t == "*" else t for t in stream_subjects[0].split("."))
