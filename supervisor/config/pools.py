"""Pools: several queues in one supervisor, each a [pools.NAME] with its own durable consumer,
handler and workers. What a pool's entry means, as pure functions of the config tree.

A pool declares none of its keys again (keys.py derives [pools.NAME] from [workers], CONSUMER_KEYS
of [consumer] and RENAMED's keys of other sections); a key it leaves unset is that section's.
`effective` turns one pool into the Config its workers and the parent's rooms for it read: the
same tree with its [workers], [consumer] (and [ordering]) sections replaced, so nothing downstream
knows pools exist. With no [pools.*] there is one pool, DEFAULT, whose effective config is the
config itself.

Imports only the subject grammar: keys.py imports this module to check pools.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from supervisor.config.subjects import overlap_example, subjects_overlap
from supervisor.errors import ConfigError

DEFAULT = "default"             # the one pool of a config without [pools.*]
# The [consumer] keys a pool may set; its durable name is its own `consumer` key.
CONSUMER_KEYS = ("filter_subject", "ack_wait", "max_deliver", "max_ack_pending", "backoff")
OWN = "consumer"
# Keys of other sections a pool may set, under a name of its own: pool key -> (section, key).
RENAMED = {"ordering_key": ("ordering", "key")}
# What a durable consumer's name may not hold (the server refuses it; it is a subject token).
BAD_DURABLE = frozenset(" \t\r\n.*>/\\")


def names(cfg: Any) -> tuple[str, ...]:
    """The pools of a config, in the file's order."""
    return tuple(cfg.pools) or (DEFAULT,)


def set_keys(entry: Any) -> dict[str, Any]:
    """The keys a [pools.NAME] entry sets (the rest it takes from [workers]/[consumer])."""
    return {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)
            if f.name != OWN and getattr(entry, f.name) is not None}


def source(pool_key: str) -> tuple[str, str]:
    """The section and key a pool's key stands for: ("consumer", "ack_wait"), ("ordering", "key")."""
    return RENAMED.get(pool_key) or ("consumer" if pool_key in CONSUMER_KEYS else "workers", pool_key)


def pool_key(dotted: str) -> str:
    """The name a pool sets `dotted` ("workers.count", "ordering.key") by: "count", "ordering_key"."""
    return next((k for k, where in RENAMED.items() if where == tuple(dotted.split(".", 1))), dotted.split(".", 1)[1])


def consumer_name(cfg: Any, name: str) -> str:
    """A pool's durable consumer: its `consumer`, else "<consumer.name>-<NAME>"."""
    if not cfg.pools:
        return str(cfg.consumer.name)
    return cfg.pools[name].consumer or f"{cfg.consumer.name}-{name}"


def effective(cfg: Any, name: str) -> Any:
    """The Config pool `name` runs with: [workers], [consumer] and [ordering] with the pool's keys
    over them and its consumer's name. Without [pools.*], DEFAULT's is the config itself."""
    if not cfg.pools:
        if name != DEFAULT:
            raise KeyError(name)
        return cfg
    sections: dict[str, dict[str, Any]] = {"consumer": {"name": consumer_name(cfg, name)}}
    for k, v in set_keys(cfg.pools[name]).items():
        section, key = source(k)
        sections.setdefault(section, {})[key] = v
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v) for s, v in sections.items()})


def select(cfg: Any, only: Sequence[str]) -> tuple[str, ...]:
    """The pools `start --pool NAME ...` runs (all without the flag), in the config's order; a
    name the config does not hold is exit 2 naming it and the ones it does."""
    known = names(cfg)
    unknown = [n for n in only if n not in known]
    if unknown:
        raise ConfigError("--pool", f"no pool named {', '.join(map(repr, unknown))}; the config has "
                                    f"{', '.join(known)}" + ("" if cfg.pools else " (no [pools.*]: one pool, default)"))
    return tuple(n for n in known if not only or n in only)


def pick(cfg: Any, pool: str | None) -> Any:
    """The config a one-shot command (`lag`, `pause`, `resume`) acts on: `--pool NAME`'s
    effective config; without it the config's one pool. Several pools and no --pool is exit 2."""
    if pool is not None:
        return effective(cfg, select(cfg, [pool])[0])
    if len(cfg.pools) > 1:
        raise ConfigError("--pool", f"the config has several pools ({', '.join(cfg.pools)}): name one")
    return effective(cfg, names(cfg)[0])


def filters(pool_cfg: Any) -> tuple[str, ...]:
    """The subjects a pool's consumer takes: its filter, else every subject of the stream."""
    return (pool_cfg.consumer.filter_subject,) if pool_cfg.consumer.filter_subject else tuple(pool_cfg.stream.subjects)


def first_overlap(pools: Iterable[tuple[str, Any]]) -> tuple[str, str, str, str, str] | None:
    """(pool, other pool, its filter, the other's, a subject both take) for the first two pools
    whose consumers would share subjects; None when no two do."""
    seen: list[tuple[str, tuple[str, ...]]] = []
    for name, pool_cfg in pools:
        mine = filters(pool_cfg)
        for other, theirs in seen:
            for a in theirs:
                for b in mine:
                    if subjects_overlap(a, b):
                        return name, other, b, a, overlap_example(a, b)
        seen.append((name, mine))
    return None


def durable_problem(name: str) -> str:
    """Why a pool's `consumer` cannot name a durable consumer ("" when it can)."""
    if any(c in BAD_DURABLE for c in name):
        return f"{name!r} is not a durable consumer name (no spaces, '.', '*', '>' or slashes)"
    return ""
