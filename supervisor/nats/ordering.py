"""The parent's side of [ordering]: how many jobs each key has in the stream (/status `ordering.
backlog`), from the stream's per-subject counts (STREAM.INFO `subjects_filter`), grouped by key.

Each subject's count costs the server a line in its answer, so the count is skipped (and /status
says why) on a stream with more than MAX_SUBJECTS distinct subjects; the monitor asks every
BACKLOG_EVERY seconds, not every poll."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

from supervisor.config import Config
from supervisor.config.ordering import key_of, token_of
from supervisor.config.schedules import job_subjects

BACKLOG_EVERY = 2.0        # seconds between two counts
MAX_SUBJECTS = 10000       # distinct subjects in the stream beyond which keys are not counted
TOP = 10                   # keys shown, the most jobs first
TIMEOUT = 5.0


async def stream_info(nc: Any, stream: str, subjects_filter: str = "") -> dict[str, Any]:
    body = json.dumps({"subjects_filter": subjects_filter}).encode() if subjects_filter else b""
    reply = json.loads((await nc.request(f"$JS.API.STREAM.INFO.{stream}", body, timeout=TIMEOUT)).data)
    if "error" in reply:
        raise RuntimeError(reply["error"].get("description", "refused"))
    return reply


async def backlog(nc: Any, cfg: Config) -> dict[str, Any]:
    """{"keys": distinct keys with jobs stored, "jobs": their jobs, "top": [{"key", "jobs"}]}, or
    keys and jobs None and a `note` when there are too many subjects to count."""
    token = token_of(cfg.ordering.key)
    assert token is not None
    state = (await stream_info(nc, cfg.stream.name)).get("state", {})
    subjects = int(state.get("num_subjects", 0))
    if subjects > MAX_SUBJECTS:
        return {"keys": None, "jobs": None, "top": [],
                "note": f"not counted: the stream has {subjects} distinct subjects (more than {MAX_SUBJECTS})"}
    counts: Counter[str] = Counter()
    for pattern in job_subjects(cfg) if subjects else ():
        found = (await stream_info(nc, cfg.stream.name, pattern)).get("state", {}).get("subjects") or {}
        for subject, n in found.items():
            key = key_of(subject, token)
            if key is not None:
                counts[key] += int(n)
    return {"keys": len(counts), "jobs": sum(counts.values()),
            "top": [{"key": k, "jobs": n} for k, n in counts.most_common(TOP)]}


class Backlog:
    """The last count (`counts`, {} before the first) and when it was taken (`at`, monotonic)."""

    def __init__(self) -> None:
        self.counts: dict[str, Any] = {}
        self.at = 0.0
        self.due = 0.0

    async def poll(self, nc: Any, cfg: Config) -> None:
        """Count again if [ordering] is on and BACKLOG_EVERY has passed; an error is the count's note."""
        now = time.monotonic()
        if not cfg.ordering.key or now < self.due:
            return
        self.due = now + BACKLOG_EVERY
        try:
            self.counts = await backlog(nc, cfg)
        except Exception as exc:
            self.counts = {"keys": None, "jobs": None, "top": [], "note": f"{type(exc).__name__}: {exc}"[:200]}
        self.at = time.monotonic()
