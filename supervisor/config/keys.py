"""The one config tree: every key declared once, with its comment, bounds and reload rule, and
what makes a value valid (`build`: each key against its declaration, then the rules that
involve several keys).

Each key is a dataclass field whose metadata carries its comment and its bounds; loading
(loading.py), `config init` / `config show` (rendering.py) and SIGHUP's plan (reload.py) all read
these declarations, so the example config can never drift from the code.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import supervisor.config.pools as pool_rules
from supervisor.config.ordering import problems as ordering_problems
from supervisor.config.ordering import token_of
from supervisor.config.schedules import ROOT, entry_problems, in_space, job_subjects
from supervisor.config.subjects import parse_hostport, subject_matches, valid_subject
from supervisor.errors import ConfigError

ENV_PREFIX = "SUPERVISOR_"
ENV_CONFIG_PATH = "SUPERVISOR_CONFIG"


# How SIGHUP applies a key (supervisor/config/reload.py reads these):
LIVE = "live"              # the parent applies it at once
REPLACE = "replace"        # workers read it at fork: replace them one at a time, replacement first
RESTART = "restart"        # fixed for the life of the process: logged, applied at the next start


def key(default: Any, doc: str, *, reload: str, lo: float | None = None, hi: float | None = None,
        choices: tuple[str, ...] | None = None, secret: bool = False) -> Any:
    """Declare one config key: its default, its comment, how a reload applies it, its bounds."""
    assert reload in (LIVE, REPLACE, RESTART), reload
    meta = {"doc": doc, "lo": lo, "hi": hi, "choices": choices, "secret": secret, "reload": reload}
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class NatsConfig:
    servers: tuple[str, ...] = key((), "empty: start the embedded nats-server", reload=RESTART, secret=True)
    name: str = key("jetstream-supervisor", "connection name shown in the server's monitoring", reload=RESTART)
    creds_file: str = key("", "JWT + NKey .creds", reload=RESTART)
    nkey_seed_file: str = key("", "NKey seed (user auth by public key)", reload=RESTART)
    token_file: str = key("", "auth token", reload=RESTART)
    user: str = key("", "with password_file: user/password auth", reload=RESTART)
    password_file: str = key("", "", reload=RESTART)
    tls_ca_file: str = key("", "private CA for the server certificate", reload=RESTART)
    tls_cert_file: str = key("", "with tls_key_file: mutual TLS", reload=RESTART)
    tls_key_file: str = key("", "", reload=RESTART)
    startup_timeout: float = key(30.0, "seconds `start` keeps trying before exit 4", reload=RESTART, lo=0.0)
    connect_timeout: float = key(2.0, "one-shot commands give up after this (exit 4); also each connect attempt",
                                 reload=RESTART, lo=0.1)


@dataclass(frozen=True)
class EmbeddedConfig:
    host: str = key("127.0.0.1", "only used when nats.servers is empty", reload=RESTART)
    port: int = key(4222, "client port; 0 picks a free one", reload=RESTART, lo=0, hi=65535)
    monitor_port: int = key(8222, "the server's HTTP monitoring (/jsz, /healthz); 0 disables; -1 picks a free one",
                            reload=RESTART, lo=-1, hi=65535)
    store_dir: str = key("", "\"\": $STATE_DIRECTORY or $XDG_STATE_HOME/jetstream-supervisor (kept across restarts); "
                             "\":memory:\" a throw-away temp dir", reload=RESTART)


@dataclass(frozen=True)
class StreamConfig:
    name: str = key("JOBS", "the work-queue stream", reload=RESTART)
    subjects: tuple[str, ...] = key(("jobs.>",), "subjects the stream captures", reload=RESTART)
    create: bool = key(True, "create when missing; never silently change an existing stream", reload=RESTART)
    storage: str = key("file", "file or memory", reload=RESTART, choices=("file", "memory"))
    replicas: int = key(1, "copies in a cluster", reload=RESTART, lo=1, hi=5)
    retention: str = key("workqueue", "workqueue, limits or interest", reload=RESTART,
                         choices=("workqueue", "limits", "interest"))
    duplicate_window: float = key(120.0, "seconds a Nats-Msg-Id is remembered", reload=RESTART, lo=0.0)
    allow_schedules: bool = key(True, "a stream we create allows NATS message schedules (publish --delay/--at, "
                                      "[schedules.NAME]; nats-server 2.12+); an existing one is never changed",
                                reload=RESTART)


@dataclass(frozen=True)
class ConsumerConfig:
    # Every consumer key is pushed to the server by a reload (supervisor/nats/provision.py).
    name: str = key("workers", "the durable pull consumer every worker binds to", reload=RESTART)
    filter_subject: str = key("", "empty: every subject of the stream", reload=LIVE)
    ack_wait: float = key(30.0, "seconds before an unacked delivery is redelivered", reload=LIVE, lo=0.001)
    max_deliver: int = key(10, "deliveries before the server gives up on a job; it is then copied to "
                               "restart.dead_letter_subject (-1 = retry forever)", reload=LIVE, lo=-1)
    max_ack_pending: int = key(1000, "jobs in flight across all workers", reload=LIVE, lo=1)
    backoff: tuple[float, ...] = key((), "server-side redelivery delays (seconds) by delivery count", reload=LIVE)


@dataclass(frozen=True)
class WorkersConfig:
    count: int = key(4, "worker processes", reload=LIVE, lo=0, hi=1024)
    handler: str = key("", "MOD:FUNC called for each job; `start` needs one (to try things: "
                           "workers.examples:sleep_job)", reload=REPLACE)
    init: str = key("", "MOD:FUNC called once in each worker after fork", reload=REPLACE)
    middleware: tuple[str, ...] = key((), "MOD:CLASS entries, each a workers.Middleware subclass wrapping every job, "
                                          "outermost first (README: Middleware)", reload=REPLACE)
    concurrency: int = key(1, "jobs in flight at once per worker", reload=REPLACE, lo=1, hi=1024)
    batch: int = key(256, "ceiling on jobs a worker asks for at once (it buffers 4 such requests at most); it "
                          "sizes pulls below it (README: Pull sizing)", reload=REPLACE, lo=1, hi=4096)
    job_timeout: float = key(0.0, "hard limit per job (the worker is killed); 0 = none", reload=LIVE, lo=0.0)
    soft_timeout: float = key(0.0, "at this age workers.SoftTimeout is raised inside the job (a failure for "
                                   "[retry]; the worker lives on); 0 = none; below job_timeout", reload=REPLACE, lo=0.0)
    heartbeat_timeout: float = key(30.0, "a worker silent this long is killed", reload=LIVE, lo=0.1)
    max_jobs: int = key(0, "recycle a worker after this many jobs (0 = never) ...", reload=LIVE, lo=0)
    max_jobs_jitter: int = key(0, "... plus a random 0..jitter", reload=LIVE, lo=0)
    max_rss_mb: int = key(0, "recycle a worker whose RSS exceeds this (0 = never)", reload=LIVE, lo=0)
    graceful_timeout: float = key(30.0, "on stop/recycle: time to finish in-flight jobs", reload=REPLACE, lo=0.0)
    double_ack: bool = key(False, "true: ack_sync (exactly-once with Nats-Msg-Id)", reload=REPLACE)
    retry_backoff: tuple[float, ...] = key((), "the old name of [retry]: NAK delays by attempt for failed jobs, "
                                               "exactly (the last repeats); empty: [retry] (README: When jobs fail)",
                                           reload=REPLACE)
    progress_pings: bool = key(True, "keep running jobs from redelivery with +WPI before AckWait; false only to "
                                     "diagnose", reload=LIVE)


@dataclass(frozen=True)
class RetryRule:
    """One [[retry.rules]] entry; an unset base/max/jitter is [retry]'s."""
    on: tuple[str, ...] = key((), "exceptions it matches, by MRO: \"ValueError\", \"pkg.mod:Error\"", reload=REPLACE)
    action: str = key("retry", "retry, or reject: dead-letter at once", reload=REPLACE, choices=("retry", "reject"))
    max_attempts: int = key(0, "deliveries for jobs failing this way; 0 = consumer.max_deliver", reload=REPLACE, lo=0)
    base: float | None = key(None, "first delay (unset: retry.base)", reload=REPLACE, lo=0.0)
    max: float | None = key(None, "delay cap (unset: retry.max)", reload=REPLACE, lo=0.0)
    jitter: float | None = key(None, "(unset: retry.jitter)", reload=REPLACE, lo=0.0, hi=1.0)


@dataclass(frozen=True)
class RetryConfig:
    base: float = key(1.0, "first delay after a failure; doubled each attempt (base * 2**(attempt-1))",
                      reload=REPLACE, lo=0.0)
    max: float = key(300.0, "delay cap", reload=REPLACE, lo=0.0)
    jitter: float = key(0.3, "each delay is drawn from [d * (1 - jitter), d]", reload=REPLACE, lo=0.0, hi=1.0)
    republish_after: float = key(60.0, "a delay longer than this re-publishes the job as a scheduled message and "
                                       "acks the old one (no ack-pending slot held); 0 = never", reload=REPLACE, lo=0.0)
    rules: tuple[RetryRule, ...] = key((), "[[retry.rules]] below, first match wins (drop this line to add one)",
                                      reload=REPLACE)


@dataclass(frozen=True)
class RestartConfig:
    backoff_initial: float = key(0.1, "first restart delay of a crashed slot", reload=LIVE, lo=0.0)
    backoff_max: float = key(30.0, "restart delay ceiling", reload=LIVE, lo=0.0)
    boot_failures_to_halt: int = key(10, "consecutive workers dying before ready -> exit 5", reload=LIVE, lo=1)
    poison_after_crashes: int = key(3, "a job running at this many worker deaths is quarantined", reload=LIVE, lo=1)
    dead_letter_subject: str = key("dlq.jobs", "where rejected, poison and max-delivered jobs are copied",
                                   reload=REPLACE)
    dead_letter_stream: str = key("JOBS_DLQ", "created (when stream.create) to keep dead letters; \"\" = none",
                                  reload=RESTART)


@dataclass(frozen=True)
class IdempotencyConfig:
    enabled: bool = key(False, "true: skip jobs whose key is already done (KV done-markers)", reload=REPLACE)
    bucket: str = key("JOBS_DONE", "JetStream KV bucket of done-markers (created when stream.create)",
                      reload=RESTART)
    ttl: float = key(86400.0, "seconds a done-marker is kept (should exceed how long duplicates can arrive)",
                     reload=RESTART, lo=1.0)


@dataclass(frozen=True)
class FleetConfig:
    name: str = key("", "this supervisor's name in the fleet view; \"\" = hostname", reload=RESTART)
    bucket: str = key("SUPERVISOR_FLEET", "KV bucket of supervisor heartbeats", reload=RESTART)
    heartbeat: float = key(2.0, "seconds between heartbeats; lost after 3 missed", reload=LIVE, lo=0.1)
    release_lost: bool = key(True, "NAK a lost supervisor's held jobs now, not after AckWait (README: partitions)",
                             reload=LIVE)
    limits_bucket: str = key("SUPERVISOR_LIMITS", "KV bucket of [limits.NAME] slots and pause reasons, shared by "
                                                  "every supervisor", reload=RESTART)


@dataclass(frozen=True)
class AutoscaleConfig:
    enabled: bool = key(False, "true: the supervisor sets the worker count between min and max", reload=LIVE)
    min: int = key(1, "never fewer workers than this", reload=LIVE, lo=0, hi=1024)
    max: int = key(8, "never more workers than this", reload=LIVE, lo=1, hi=1024)
    interval: float = key(1.0, "seconds between decisions", reload=LIVE, lo=0.1)
    budget: int = key(0, "autoscaling keeps all pools together at most this many workers (0 = no shared cap; a count "
                         "set by hand may pass it); the next goes to the pool where it does the most work (README: "
                         "Pools)", reload=LIVE, lo=0, hi=65536)


@dataclass(frozen=True)
class MonitorConfig:
    interval: float = key(1.0, "ConsumerInfo poll period", reload=LIVE, lo=0.05)
    lag_window: float = key(60.0, "window for the pending trend", reload=LIVE, lo=1.0)
    http: str = key("127.0.0.1:9520", "/, /status, /metrics, /healthz; \"\" disables; port 0 picks a free one (logged)",
                    reload=RESTART)


@dataclass(frozen=True)
class TracingConfig:
    enabled: bool = key(False, "true: a span per delivery, exported from each worker (needs the otel extra; "
                               "README: Tracing)", reload=REPLACE)
    exporter: str = key("otlp", "otlp (OTLP/HTTP protobuf) or console (stdout)", reload=REPLACE,
                        choices=("otlp", "console"))
    endpoint: str = key("http://127.0.0.1:4318", "the collector's OTLP/HTTP base URL (/v1/traces is added); "
                                                 "OTEL_EXPORTER_OTLP_ENDPOINT wins when set", reload=REPLACE)
    service_name: str = key("jetstream-supervisor", "the spans' service.name", reload=REPLACE)


@dataclass(frozen=True)
class OrderingConfig:
    # Workers read it at fork (workers/runtime/ordering.py); the parent for /status.
    key: str = key("", "\"\": unordered. \"subject:N\": the N-th token (1-based) of a job's subject is its key; jobs "
                       "of one key run one at a time in stream order, keys in parallel (README: Ordered per key)",
                   reload=REPLACE)


@dataclass(frozen=True)
class LogConfig:
    level: str = key("info", "debug, info, warning or error", reload=LIVE,
                     choices=("debug", "info", "warning", "error"))
    format: str = key("text", "text or json", reload=RESTART, choices=("text", "json"))


# ---------------------------------------------------------------- named sections: [schedules.NAME], ...
# A named section holds any number of entries, each a table of the same keys ([limits.db],
# [limits.mail]); every entry is checked against its dataclass like a fixed section, its keys
# named `section.NAME.key` in errors. They are set in the config file only (no environment
# override: a name may hold underscores), and `config init` shows each as a commented example.

NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass(frozen=True)
class ScheduleConfig:
    every: float = key(0.0, "seconds between firings, at least 1 (this or cron)", reload=LIVE)
    cron: str = key("", "\"MIN HOUR DAY MONTH WEEKDAY\", UTC, as crontab (6 fields: seconds first)", reload=LIVE)
    subject: str = key("", "where each firing publishes a job; \"\": as `publish` (e.g. jobs.new)", reload=LIVE)
    data: str = key("", "the job's payload", reload=LIVE)
    headers: tuple[str, ...] = key((), "\"Name: value\" headers each job carries", reload=LIVE)


@dataclass(frozen=True)
class LimitConfig:
    # Workers take limits (workers/middleware/limits.py) with the config they were forked with.
    concurrency: int = key(0, "jobs holding it at once across the fleet (0 = no cap)", reload=REPLACE, lo=0,
                           hi=100000)
    rate: float = key(0.0, "acquisitions per second across the fleet (0 = none)", reload=REPLACE, lo=0.0)
    subjects: tuple[str, ...] = key((), "jobs on these subjects hold it for their whole run (README: Protecting "
                                        "what is behind the workers)", reload=REPLACE)


def _pool_fields() -> list[tuple[str, Any, Any]]:
    """[pools.NAME]'s keys, derived, not declared again: every [workers] key, the
    pool_rules.CONSUMER_KEYS of [consumer] and pool_rules.RENAMED's ([ordering]'s key as
    `ordering_key`), each with its declaration's comment, bounds and reload rule but no default
    (unset: None, the pool takes the section's value); and the pool's own `consumer`, its durable
    name."""
    classes = {"workers": WorkersConfig, "consumer": ConsumerConfig, "ordering": OrderingConfig}
    declared = {(s, f.name): f for s, c in classes.items() for f in dataclasses.fields(c)}
    inherited = [*((f.name, ("workers", f.name)) for f in dataclasses.fields(WorkersConfig)),
                 *((f.name, ("consumer", f.name)) for f in dataclasses.fields(ConsumerConfig)
                   if f.name in pool_rules.CONSUMER_KEYS), *pool_rules.RENAMED.items()]
    out = [(name, typing.get_type_hints(classes[s])[k] | None,
            field(default=None, metadata={**declared[s, k].metadata, "inherits": f"{s}.{k}"}))
           for name, (s, k) in inherited]
    own = (pool_rules.OWN, str, key("", "its durable pull consumer; \"\" = \"<consumer.name>-<NAME>\" (a change restarts "
                                        "the pool on the new one)", reload=LIVE))
    first = ("handler", "count", "filter_subject")         # what `config init`'s example shows first
    return sorted([*out, own], key=lambda f: first.index(f[0]) if f[0] in first else len(first))


PoolConfig = dataclasses.make_dataclass("PoolConfig", _pool_fields(), frozen=True)
PoolConfig.__doc__ = "One [pools.NAME]: a queue of its own in this supervisor (config/pools.py)."

NAMED: dict[str, type] = {"schedules": ScheduleConfig, "limits": LimitConfig, "pools": PoolConfig}

# Keys that were in a plan or a release and are no more: setting one is exit 2 saying why.
RETIRED: dict[str, str] = {
    "ordering.partitions": "jobs are ordered per key by the stream itself: there are no partitions to hash keys "
                           "into, so no key waits behind another hashed into its partition (README: Ordered per key); "
                           "remove it",
}


@dataclass(frozen=True)
class Config:
    nats: NatsConfig = NatsConfig()
    embedded: EmbeddedConfig = EmbeddedConfig()
    stream: StreamConfig = StreamConfig()
    consumer: ConsumerConfig = ConsumerConfig()
    workers: WorkersConfig = WorkersConfig()
    retry: RetryConfig = RetryConfig()
    restart: RestartConfig = RestartConfig()
    idempotency: IdempotencyConfig = IdempotencyConfig()
    fleet: FleetConfig = FleetConfig()
    autoscale: AutoscaleConfig = AutoscaleConfig()
    monitor: MonitorConfig = MonitorConfig()
    tracing: TracingConfig = TracingConfig()
    ordering: OrderingConfig = OrderingConfig()
    log: LogConfig = LogConfig()
    schedules: Mapping[str, ScheduleConfig] = field(default_factory=lambda: Entries())
    limits: Mapping[str, LimitConfig] = field(default_factory=lambda: Entries())
    pools: Mapping[str, Any] = field(default_factory=lambda: Entries())     # PoolConfig entries

    def replace(self, **sections: dict[str, Any]) -> Config:
        """A copy with some keys changed (a named section: whole entries), validated like a
        loaded config."""
        raw = as_dict(self)
        for section, values in sections.items():
            raw.setdefault(section, {}).update(values)
        return build(raw, {f"{s}.{k}": "override" for s, v in sections.items() for k in v})


SECTIONS: dict[str, type] = {s: t for s, t in typing.get_type_hints(Config).items() if s not in NAMED}


def section_class(section: str) -> type:
    """The dataclass a section's keys are declared in (a named section's: its entries')."""
    return SECTIONS.get(section) or NAMED[section]


def section_keys(section: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_class(section))}


def key_type(section: str, name: str) -> Any:
    return typing.get_type_hints(section_class(section))[name]


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """Tuples as lists; a list of tables ([[retry.rules]]) as plain tables, unset keys left out."""
    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items() if x is not None}
        return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v
    return {k: plain(v) for k, v in values.items()}


def as_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The tree as plain TOML-shaped data; a named section only when it has entries (as in a file)."""
    out = {s: _plain(dataclasses.asdict(getattr(cfg, s))) for s in SECTIONS}
    for s in NAMED:
        if getattr(cfg, s):
            out[s] = {name: _plain(dataclasses.asdict(entry)) for name, entry in getattr(cfg, s).items()}
    return out


class Entries(Mapping[str, Any]):
    """A named section's entries, read-only and hashable like the rest of the frozen tree."""

    def __init__(self, entries: Mapping[str, Any] | None = None):
        self._entries = dict(entries or {})

    def __getitem__(self, name: str) -> Any:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._entries.items())))

    def __repr__(self) -> str:
        return f"Entries({self._entries!r})"


# ---------------------------------------------------------------- building and checking

def build(raw: Mapping[str, Mapping[str, Any]], sources: Mapping[str, str]) -> Config:
    sections: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        values = {}
        for name in section_keys(section):
            dotted = f"{section}.{name}"
            values[name] = _check_value(dotted, raw[section][name], key_type(section, name),
                                        section_keys(section)[name].metadata, sources.get(dotted, ""))
        sections[section] = cls(**values)
    for section in NAMED:
        sections[section] = Entries({name: _entry(section, name, values, sources)
                                     for name, values in raw.get(section, {}).items()})
    cfg = Config(**sections)
    _check_together(cfg, sources)
    return cfg


def _entry(section: str, name: str, values: Mapping[str, Any], sources: Mapping[str, str]) -> Any:
    """One entry of a named section: each key checked like any other, absent keys at their default."""
    cls, out = NAMED[section], {}
    for key_name, f in section_keys(section).items():
        dotted = f"{section}.{name}.{key_name}"
        default = f.default if f.default is not dataclasses.MISSING else None
        out[key_name] = _check_value(dotted, values.get(key_name, default), key_type(section, key_name),
                                     f.metadata, sources.get(dotted, ""))
    return cls(**out)


def _check_value(dotted: str, value: Any, typ: Any, meta: Mapping[str, Any], source: str) -> Any:
    value = _coerce(dotted, value, typ, source, meta["secret"])
    if value is None or table_type(typ):
        return value                     # an unset optional key; a list of tables checked its own keys
    items = value if isinstance(value, tuple) else (value,)
    for item in items:
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            if meta["lo"] is not None and item < meta["lo"]:
                raise ConfigError(dotted, f"must be at least {meta['lo']:g}, got {item!r}", source)
            if meta["hi"] is not None and item > meta["hi"]:
                raise ConfigError(dotted, f"must be at most {meta['hi']:g}, got {item!r}", source)
        if meta["choices"] and item not in meta["choices"]:
            raise ConfigError(dotted, f"must be one of {', '.join(meta['choices'])}; got {item!r}", source)
    return value


def _coerce(dotted: str, value: Any, typ: Any, source: str, secret: bool = False) -> Any:
    def wrong() -> ConfigError:
        return ConfigError(dotted, f"expected {type_name(typ)}, got {_describe(value, secret)}", source)

    if optional(typ):
        return None if value is None else _coerce(dotted, value, optional(typ), source, secret)
    if table := table_type(typ):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, (dict, table)) for v in value):
            raise ConfigError(dotted, f"expected [[{dotted}]] tables, got {_describe(value, secret)}", source)
        return tuple(v if isinstance(v, table) else _table(f"{dotted}[{k}]", table, v, source)
                     for k, v in enumerate(value))
    if typing.get_origin(typ) is tuple:
        if not isinstance(value, (list, tuple)):
            raise wrong()
        item_type = typing.get_args(typ)[0]
        return tuple(_coerce(dotted, v, item_type, source, secret) for v in value)
    if typ is bool:
        if not isinstance(value, bool):
            raise wrong()
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong()
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise wrong()
        return float(value)
    if typ is str and not isinstance(value, str):
        raise wrong()
    return value


def optional(typ: Any) -> Any:
    """`float | None` -> float; None for a type that is not optional."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None))
    return None


def table_type(typ: Any) -> type | None:
    """The dataclass of a list-of-tables key (`tuple[RetryRule, ...]`: [[retry.rules]]), else None."""
    if typing.get_origin(typ) is tuple and dataclasses.is_dataclass(item := typing.get_args(typ)[0]):
        return typing.cast(type, item)
    return None


def _table(dotted: str, cls: type, values: Mapping[str, Any], source: str) -> Any:
    """One table of a list-of-tables key: each key checked like any other, absent keys at their default."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for name in values:
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.5)
            raise ConfigError(f"{dotted}.{name}", "unknown key" + (f"; did you mean {close[0]}?" if close else ""), source)
    return cls(**{name: _check_value(f"{dotted}.{name}", values.get(name, f.default), hints[name], f.metadata, source)
                  for name, f in fields.items()})


def type_name(typ: Any) -> str:
    if optional(typ):
        return type_name(optional(typ))
    if table_type(typ):
        return "a list of tables"
    if typing.get_origin(typ) is tuple:
        return "a list of " + {bool: "booleans", int: "integers", float: "numbers (seconds)",
                               str: "strings"}[typing.get_args(typ)[0]]
    return {bool: "true or false", int: "an integer", float: "a number (seconds)", str: "a string"}[typ]


def _describe(value: Any, secret: bool = False) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)
    return f"{kind} ({value!r})" if not isinstance(value, (list, dict)) and not secret else kind


def _check_together(cfg: Config, sources: Mapping[str, str]) -> None:
    """Rules that involve more than one key."""
    def fail(dotted: str, problem: str) -> None:
        raise ConfigError(dotted, problem, sources.get(dotted, ""))

    if not cfg.stream.subjects:
        fail("stream.subjects", "needs at least one subject")
    if cfg.autoscale.max < cfg.autoscale.min:
        fail("autoscale.max", f"must be >= autoscale.min ({cfg.autoscale.min})")
    pools = max(1, len(cfg.pools))
    if cfg.autoscale.budget and cfg.autoscale.budget < cfg.autoscale.min * pools:
        fail("autoscale.budget", f"must be 0 or at least autoscale.min for every pool ({cfg.autoscale.min} x {pools} "
                                 f"= {cfg.autoscale.min * pools})")
    if any(not valid_subject(s, wildcards=True) for s in cfg.stream.subjects):
        bad = next(s for s in cfg.stream.subjects if not valid_subject(s, True))
        fail("stream.subjects", f"not a valid subject: {bad!r}")
    _check_queue(cfg, fail)
    _check_retry(cfg, fail, sources)
    if cfg.restart.backoff_max < cfg.restart.backoff_initial:
        fail("restart.backoff_max", f"must be >= restart.backoff_initial ({cfg.restart.backoff_initial:g})")
    if cfg.tracing.enabled and (missing := otel_missing()):
        fail("tracing.enabled", f"needs the otel extra: {missing} is not installed "
                                "(pip install 'jetstream-supervisor[otel]')")
    dlq = cfg.restart.dead_letter_subject
    if dlq and not valid_subject(dlq, wildcards=False):
        fail("restart.dead_letter_subject", f"{dlq!r} must be a plain subject (no spaces, no wildcards)")
    if dlq and any(subject_matches(pattern, dlq) for pattern in cfg.stream.subjects):
        fail("restart.dead_letter_subject",
             f"{dlq!r} is captured by stream.subjects; dead letters would be redelivered as jobs")
    if cfg.monitor.http:
        parse_hostport(cfg.monitor.http, "monitor.http", sources.get("monitor.http", ""))
    for dotted in ("nats.tls_cert_file", "nats.tls_key_file"):
        other = "nats.tls_key_file" if dotted.endswith("cert_file") else "nats.tls_cert_file"
        if getattr(cfg.nats, dotted.split(".")[1]) and not getattr(cfg.nats, other.split(".")[1]):
            fail(dotted, f"needs {other} too (mutual TLS takes both)")
    if cfg.nats.password_file and not cfg.nats.user:
        fail("nats.password_file", "needs nats.user")
    for server in cfg.nats.servers:
        if not server or " " in server:
            fail("nats.servers", "each server must be a URL like nats://host:4222")
    _check_limits(cfg, fail)
    _check_schedules(cfg, fail)
    if cfg.pools:                 # each pool's, on its own filter: _check_pools
        _check_ordering_spec(cfg, fail)
    else:
        _check_ordering(cfg, fail)
    _check_pools(cfg, sources)


def _check_queue(cfg: Config, fail: Callable[[str, str], None]) -> None:
    """The rules on [workers] and [consumer] together: checked for the config, and again for each
    pool's effective config (_check_pools names the pool's key)."""
    for dotted in ("workers.handler", "workers.init"):
        spec = getattr(cfg.workers, dotted.split(".")[1])
        if spec and (spec.count(":") != 1 or not all(spec.split(":"))):
            fail(dotted, f"expected MODULE:FUNCTION, got {spec!r}")
    for spec in cfg.workers.middleware:
        if spec.count(":") != 1 or not all(spec.split(":")):
            fail("workers.middleware", f"expected MODULE:CLASS entries, got {spec!r}")
    w = cfg.workers
    if w.soft_timeout and w.job_timeout and w.soft_timeout >= w.job_timeout:
        fail("workers.soft_timeout", f"must be below workers.job_timeout ({w.job_timeout:g}), the hard limit that kills")
    if cfg.consumer.backoff and cfg.consumer.max_deliver != -1 and cfg.consumer.max_deliver <= len(cfg.consumer.backoff):
        fail("consumer.backoff", "needs consumer.max_deliver greater than its length (a NATS rule)")
    if cfg.consumer.max_deliver == 0:
        fail("consumer.max_deliver", "must be -1 (unlimited) or at least 1")
    for dotted in ("workers.retry_backoff", "consumer.backoff"):
        section, name = dotted.split(".")
        if any(d < 0 for d in getattr(getattr(cfg, section), name)):
            fail(dotted, "delays cannot be negative")
    f = cfg.consumer.filter_subject
    if f and not valid_subject(f, wildcards=True):
        fail("consumer.filter_subject", f"not a valid subject: {f!r}")
    if f and not any(subject_matches(p, f) or p == f for p in cfg.stream.subjects):
        fail("consumer.filter_subject", f"{f!r} is not within stream.subjects")


def _check_pools(cfg: Config, sources: Mapping[str, str]) -> None:
    """Each [pools.NAME]: its consumer's name, its effective config by the rules of a single
    queue (an error names `pools.NAME.key`, or the inherited key it comes from), one consumer per
    pool, and on a work-queue stream no two pools' filters sharing a subject (the server hands a
    message to one consumer only and refuses the second: say it first, naming both)."""
    consumers: dict[str, str] = {}
    for name, entry in cfg.pools.items():
        def fail(dotted: str, problem: str, name: str = name, entry: Any = entry) -> None:
            section, k = dotted.split(".", 1)[0], pool_rules.pool_key(dotted)
            if getattr(entry, k, None) is not None:
                raise ConfigError(f"pools.{name}.{k}", problem, sources.get(f"pools.{name}.{k}", ""))
            raise ConfigError(f"pools.{name}", f"{dotted} (not set in the pool, so [{section}]'s): {problem}",
                              sources.get(dotted, ""))
        if entry.consumer and (why := pool_rules.durable_problem(entry.consumer)):
            raise ConfigError(f"pools.{name}.consumer", why, sources.get(f"pools.{name}.consumer", ""))
        pool_cfg = pool_rules.effective(cfg, name)
        _check_queue(pool_cfg, fail)
        _check_ordering(pool_cfg, fail)
        durable = pool_cfg.consumer.name
        if durable in consumers:
            raise ConfigError(f"pools.{name}.consumer", f"pools {consumers[durable]} and {name} would share consumer "
                                                        f"{durable!r}: each pool needs its own")
        consumers[durable] = name
    if cfg.stream.retention == "workqueue" and len(cfg.pools) > 1:
        clash = pool_rules.first_overlap((name, pool_rules.effective(cfg, name)) for name in cfg.pools)
        if clash:
            name, other, mine, theirs, subject = clash
            raise ConfigError(f"pools.{name}.filter_subject", (
                f"pools {other} and {name} overlap: {theirs!r} and {mine!r} both take {subject!r}; on a work-queue "
                "stream each message goes to one consumer, so the server would refuse the second (give each pool "
                "a filter_subject of its own)"), sources.get(f"pools.{name}.filter_subject", ""))


def _check_ordering_spec(cfg: Config, fail: Any) -> None:
    """With pools, [ordering]'s key alone (a pool that inherits it has it checked on its filter)."""
    try:
        token_of(cfg.ordering.key)
    except ValueError as exc:
        fail("ordering.key", str(exc))


def _check_ordering(cfg: Config, fail: Any) -> None:
    """[ordering] on a queue: its key reachable in every job subject the consumer takes, on a
    work-queue stream. Checked for the config, and again for each pool's effective config."""
    if not cfg.ordering.key:
        return
    for problem in ordering_problems(cfg.ordering.key, job_subjects(cfg)):
        fail("ordering.key", problem)
    if cfg.stream.retention != "workqueue":
        fail("ordering.key", f"needs stream.retention = \"workqueue\" (got {cfg.stream.retention!r}): a job is known done "
                             "when the stream no longer stores it")


def _check_limits(cfg: Config, fail: Any) -> None:
    for name, lim in cfg.limits.items():
        if not lim.concurrency and not lim.rate:
            fail(f"limits.{name}", "needs concurrency or rate (or both) above 0")
        for s in lim.subjects:
            if not valid_subject(s, wildcards=True):
                fail(f"limits.{name}.subjects", f"not a valid subject: {s!r}")
            if not any(subject_matches(p, s) or subject_matches(s, p) or p == s for p in cfg.stream.subjects):
                fail(f"limits.{name}.subjects", f"{s!r} is not within stream.subjects: no job would hold it")


def _check_schedules(cfg: Config, fail: Any) -> None:
    if any(in_space(s) for s in cfg.stream.subjects):
        fail("stream.subjects", f"{ROOT}.> is where message schedules are kept; job subjects go elsewhere")
    wide = [s for s in cfg.stream.subjects if subject_matches(s, f"{ROOT}.{cfg.stream.name}.probe")]
    if cfg.stream.allow_schedules and wide:
        fail("stream.subjects", f"{wide[0]!r} also captures {ROOT}.{cfg.stream.name}.>, where message schedules are "
                                "kept (out of the workers' way): narrow it, or set stream.allow_schedules = false")
    for name, entry in cfg.schedules.items():
        if not cfg.stream.allow_schedules:
            fail(f"schedules.{name}", "needs stream.allow_schedules = true")
        for problem_key, problem in entry_problems(every=entry.every, cron=entry.cron, subject=entry.subject,
                                                             headers=entry.headers, stream_subjects=cfg.stream.subjects):
            fail(f"schedules.{name}.{problem_key}", problem)


EXCEPTION_NAME = re.compile(r"[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?")


def _check_retry(cfg: Config, fail: Callable[[str, str], None], sources: Mapping[str, str]) -> None:
    """[retry] and its rules, and how workers.retry_backoff (its old name) may stand beside it."""
    r = cfg.retry
    if r.max < r.base:
        fail("retry.max", f"must be >= retry.base ({r.base:g})")
    if cfg.workers.retry_backoff and any(sources.get(f"retry.{k}") for k in ("base", "max", "jitter")):
        fail("workers.retry_backoff", "is the old name of [retry]'s delays: set retry.base/max/jitter or "
                                      "workers.retry_backoff, not both")
    for k, rule in enumerate(r.rules):
        where = f"retry.rules[{k}]"
        if not rule.on:
            fail(f"{where}.on", "needs at least one exception name (\"ValueError\", \"pkg.mod:Error\")")
        for name in rule.on:
            if not EXCEPTION_NAME.fullmatch(name):
                fail(f"{where}.on", f"{name!r} is not an exception name (\"ValueError\", \"pkg.mod:Error\")")
        base = r.base if rule.base is None else rule.base
        if (rule.max if rule.max is not None else r.max) < base:
            fail(f"{where}.max", f"must be >= its base ({base:g})")


OTEL_MODULES = {"opentelemetry-sdk": "opentelemetry.sdk.trace",
                "opentelemetry-exporter-otlp-proto-http": "opentelemetry.exporter.otlp.proto.http.trace_exporter"}


def otel_missing() -> str:
    """The otel extra's package that cannot be found ("" when all are), without importing any:
    the parent never loads the SDK (its exporters start in the workers, after fork)."""
    for package, module in OTEL_MODULES.items():
        try:
            if importlib.util.find_spec(module) is None:
                return package
        except ImportError:              # a parent package is missing altogether
            return package
    return ""
