"""SIGHUP: what a new config changes, and how much of it a running supervisor can take.

Pure: `plan(old, new)` compares two config trees key by key and sorts each change by the
`reload` each key declares in config.py: RESTART keys (the connection, the stream, the HTTP
address) are reported and keep their running value until the next start; LIVE keys are
applied by the parent (`workers.count` is a scale, `consumer.*` is pushed to the server);
REPLACE keys are read by workers at fork, so workers are replaced one at a time like a recycle.
With pools, `pools_plan` plans each pool on its effective config (config/pools.py), so a change
of [workers] reaches every pool that inherits the key, and a pool's own key reaches that pool.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from supervisor.config.keys import LIVE, NAMED, REPLACE, RESTART, Config, as_dict, section_keys
from supervisor.config.pools import consumer_name, effective


@dataclass
class Plan:
    effective: Config                    # the new config with the restart-only keys kept as they run
    changed: list[tuple[str, Any, Any]] = field(default_factory=list)
    needs_restart: list[str] = field(default_factory=list)
    scale_to: int | None = None
    update_consumer: bool = False
    replace_workers: bool = False


ORDER = (LIVE, REPLACE, RESTART)      # how much a change asks, least first


def how(dotted: str) -> str:
    """LIVE, REPLACE or RESTART, as the key declares it. A whole entry of a named section
    (`limits.db`, added or removed) asks as much as its most demanding key."""
    parts = dotted.split(".")
    keys = section_keys(parts[0])
    if parts[0] in NAMED and len(parts) == 2:
        return max((f.metadata["reload"] for f in keys.values()), key=ORDER.index)
    return keys[parts[-1]].metadata["reload"]


def changes(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> list[tuple[str, Any, Any]]:
    """(dotted key, old, new) for every key that differs; a named section's entry added or
    removed as a whole (`limits.db`)."""
    out = [(f"{s}.{k}", a[s][k], b[s][k]) for s in a if s not in NAMED for k in a[s] if a[s][k] != b[s][k]]
    for s in NAMED:
        olds, news = a.get(s, {}), b.get(s, {})
        for name in sorted({*olds, *news}):
            old, new = olds.get(name), news.get(name)
            if old is None or new is None:
                out.append((f"{s}.{name}", old, new))
            else:
                out += [(f"{s}.{name}.{k}", old[k], new[k]) for k in old if old[k] != new[k]]
    return out


def plan(old: Config, new: Config) -> Plan:
    p = Plan(effective=new)
    p.changed = changes(as_dict(old), as_dict(new))
    keep: dict[str, dict[str, Any]] = {}
    for dotted, _, _ in p.changed:
        section, name = dotted.split(".")[:2]
        if section == "pools":        # each pool's own plan says what its change does (pools_plan)
            continue
        if section in NAMED:          # applied as a whole (none of their keys is RESTART yet) ...
            p.replace_workers |= how(dotted) == REPLACE     # ... by new workers, for what workers read
            continue
        if how(dotted) == RESTART:
            p.needs_restart.append(dotted)
            keep.setdefault(section, {})[name] = getattr(getattr(old, section), name)
            continue
        if dotted == "workers.count":
            p.scale_to = new.workers.count
        elif section == "consumer":
            p.update_consumer = True
            # [ordering]'s workers size their tables by max_ack_pending and ask the stream for
            # the jobs of a key by the consumer's filter: both read at fork.
            p.replace_workers |= bool(new.ordering.key) and name in ("max_ack_pending", "filter_subject")
        if how(dotted) == REPLACE:
            p.replace_workers = True
    p.effective = dataclasses.replace(new, **{s: dataclasses.replace(getattr(new, s), **v) for s, v in keep.items()})
    return p


@dataclass
class PoolsPlan:
    """What a reload does to the pools: the plan of each pool that runs on (by name), the pools
    to start (new in the file, or on a new consumer) and those to stop (gone from the file, or
    moved to a new consumer: stopped, then started again on it)."""
    kept: dict[str, Plan] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def pools_plan(old: Config, new: Config, running: list[str], wanted: list[str]) -> PoolsPlan:
    """`running`: the pools running now; `wanted`: those the new config says to run."""
    out = PoolsPlan()
    for name in running:
        if name not in wanted or consumer_name(old, name) != consumer_name(new, name):
            out.removed.append(name)
    for name in wanted:
        if name not in running or name in out.removed:
            out.added.append(name)
        else:
            out.kept[name] = plan(effective(old, name), effective(new, name))
    return out
