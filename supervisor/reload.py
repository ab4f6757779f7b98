"""SIGHUP: what a new config changes, and how much of it a running supervisor can take.

Pure: `plan(old, new)` compares two config trees key by key. The connection and the stream are
fixed for the life of the process (a change there is reported and waits for a restart); the
consumer's updatable settings are pushed to the server; the worker count is a scale; anything
else a worker reads at fork time means fresh workers, replaced one at a time like a recycle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .config import Config, as_dict

NEEDS_RESTART = ("nats.", "embedded.", "stream.", "monitor.http", "log.format")
NO_NEW_WORKERS = ("workers.count", "monitor.", "log.", "restart.backoff_", "restart.boot_failures_to_halt",
                  "restart.poison_after_crashes", "workers.heartbeat_timeout", "workers.job_timeout",
                  "workers.max_jobs", "workers.max_rss_mb", "workers.progress_pings", "consumer.")


@dataclass
class Plan:
    changed: list[tuple[str, Any, Any]] = field(default_factory=list)
    needs_restart: list[str] = field(default_factory=list)
    scale_to: int | None = None
    update_consumer: bool = False
    replace_workers: bool = False
    effective: Config | None = None      # the new config with the restart-only keys kept as they run


def plan(old: Config, new: Config) -> Plan:
    p = Plan()
    a, b = as_dict(old), as_dict(new)
    for section in a:
        for key in a[section]:
            if a[section][key] != b[section][key]:
                p.changed.append((f"{section}.{key}", a[section][key], b[section][key]))
    keep: dict[str, dict[str, Any]] = {}
    for dotted, _, _ in p.changed:
        if dotted.startswith(NEEDS_RESTART):
            p.needs_restart.append(dotted)
            section, key = dotted.split(".")
            keep.setdefault(section, {})[key] = getattr(getattr(old, section), key)
        elif dotted == "workers.count":
            p.scale_to = new.workers.count
        elif dotted.startswith("consumer."):
            p.update_consumer = True
        if not dotted.startswith(NO_NEW_WORKERS) and not dotted.startswith(NEEDS_RESTART):
            p.replace_workers = True
    p.effective = dataclasses.replace(new, **{s: dataclasses.replace(getattr(new, s), **v) for s, v in keep.items()})
    return p
