"""Logging: text for a terminal, JSON lines for collectors, no doubled timestamps under journald.
A record logged while a job runs in a worker carries the job (supervisor/logcontext.py): a
`[w2 seq=42 #1]` prefix in text, `job_seq`, `job_delivery`, `job_subject`, `worker` (and
`trace_id`) fields in JSON; with [pools.*], a record of one pool (the parent's, or its
workers') says which: `[email]` in text, `pool` in JSON. The workers inherit these formatters
across fork."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from supervisor.logcontext import CURRENT, POOL

# Attributes every LogRecord has; anything else on a record came from `extra={...}`.
STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# journald's <N> priority prefixes (sd-daemon.h), read when SyslogLevelPrefix= is on (the default).
JOURNAL_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def under_journald(stream=None) -> bool:
    """True when stderr is the journal stream systemd gave us (JOURNAL_STREAM=dev:ino)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    if ":" not in value:
        return False
    try:
        st = os.fstat((stream or sys.stderr).fileno())
    except (OSError, ValueError):
        return False
    dev, _, ino = value.partition(":")
    return f"{st.st_dev}:{st.st_ino}" == f"{dev}:{ino}"


class TextFormatter(logging.Formatter):
    def __init__(self, journald: bool):
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        job, pool = CURRENT.get(), POOL.get()
        where = (f"[{pool}] " if pool else "") + (f"{job.prefix()} " if job is not None else "")
        text = f"{record.levelname.lower():7} {record.name}: {where}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if self.journald:            # journald stamps the time itself
            return f"<{JOURNAL_PRIORITY.get(record.levelno, 6)}>{text}"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        return f"{stamp}.{int(record.msecs):03d} [{os.getpid()}] {text}"


class JsonFormatter(logging.Formatter):
    def __init__(self, journald: bool):
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        out = {"level": record.levelname.lower(), "logger": record.name, "pid": os.getpid(),
               "message": record.getMessage()}
        if not self.journald:
            out = {"ts": round(record.created, 3), **out}
        job, pool = CURRENT.get(), POOL.get()
        if pool:
            out["pool"] = pool
        if job is not None:
            out.update(job.fields())
        # extra={"event": "worker_ready", "slot": 0, "pid": 123}: what programs and tests read
        # instead of the wording, which stays free to change.
        out.update({k: v for k, v in vars(record).items() if k not in STANDARD_ATTRS and k not in out})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str = "info", fmt: str = "text") -> None:
    journald = under_journald()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(journald) if fmt == "json" else TextFormatter(journald))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(LEVELS.get(level, logging.INFO))
    # nats-py logs through "nats"; our callbacks already say what matters in one line.
    logging.getLogger("nats").setLevel(logging.CRITICAL)
    logging.getLogger("asyncio").setLevel(logging.WARNING)
