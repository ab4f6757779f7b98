"""SIGHUP: what a new config changes, and how much of it a running supervisor can take.

Pure: `plan(old, new)` compares two config trees key by key and sorts each change by the
`reload` each key declares in config.py: RESTART keys (the connection, the stream, the HTTP
address) are reported and keep their running value until the next start; LIVE keys are
applied by the parent (`workers.count` is a scale, `consumer.*` is pushed to the server);
REPLACE keys are read by workers at fork, so workers are replaced one at a time like a recycle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from supervisor.config import REPLACE, RESTART, Config, as_dict, section_keys


@dataclass
class Plan:
    effective: Config                    # the new config with the restart-only keys kept as they run
    changed: list[tuple[str, Any, Any]] = field(default_factory=list)
    needs_restart: list[str] = field(default_factory=list)
    scale_to: int | None = None
    update_consumer: bool = False
    replace_workers: bool = False


def how(dotted: str) -> str:
    """LIVE, REPLACE or RESTART, as the key declares it."""
    section, name = dotted.split(".")
    return section_keys(section)[name].metadata["reload"]


def plan(old: Config, new: Config) -> Plan:
    p = Plan(effective=new)
    a, b = as_dict(old), as_dict(new)
    p.changed = [(f"{s}.{k}", a[s][k], b[s][k]) for s in a for k in a[s] if a[s][k] != b[s][k]]
    keep: dict[str, dict[str, Any]] = {}
    for dotted, _, _ in p.changed:
        section, name = dotted.split(".")
        if how(dotted) == RESTART:
            p.needs_restart.append(dotted)
            keep.setdefault(section, {})[name] = getattr(getattr(old, section), name)
            continue
        if dotted == "workers.count":
            p.scale_to = new.workers.count
        elif section == "consumer":
            p.update_consumer = True
        if how(dotted) == REPLACE:
            p.replace_workers = True
    p.effective = dataclasses.replace(new, **{s: dataclasses.replace(getattr(new, s), **v) for s, v in keep.items()})
    return p
