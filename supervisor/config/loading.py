"""Loading the config: defaults < file < SUPERVISOR_<SECTION>_<KEY> env < flags, then every
value checked against its declaration (keys.py) and the rules that involve several keys."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from supervisor.config.keys import (
    ENV_CONFIG_PATH,
    ENV_PREFIX,
    NAME_CHARS,
    NAMED,
    RETIRED,
    SECTIONS,
    Config,
    as_dict,
    build,
    key_type,
    section_keys,
    type_name,
)
from supervisor.errors import ConfigError


def find_config_path(explicit: str | None, env: Mapping[str, str]) -> Path | None:
    """--config, else $SUPERVISOR_CONFIG, else ./config.toml when present, else none."""
    if explicit:
        return Path(explicit)
    if env.get(ENV_CONFIG_PATH):
        return Path(env[ENV_CONFIG_PATH])
    local = Path("config.toml")
    return local if local.is_file() else None


def load(path: Path | None, env: Mapping[str, str] | None = None,
         flags: Mapping[str, Any] | None = None) -> Config:
    """Defaults < file < env < flags; raises ConfigError naming the key."""
    env = os.environ if env is None else env
    raw = as_dict(Config())
    sources: dict[str, str] = {}
    if path is not None:
        _overlay(raw, sources, read_file(path), str(path))
    _overlay(raw, sources, env_overrides(env), "environment")
    for dotted, value in (flags or {}).items():
        if value is not None:
            section, name = dotted.split(".")
            raw[section][name] = value
            sources[dotted] = "command line"
    return build(raw, sources)


# ---------------------------------------------------------------- the command line's share

# flag dest -> the config key it overrides
FLAG_KEYS = {"workers": "workers.count", "handler": "workers.handler", "http": "monitor.http",
             "log_format": "log.format"}


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys the command line sets: key -> value."""
    flags: dict[str, Any] = {key: getattr(args, dest, None) for dest, key in FLAG_KEYS.items()}
    if getattr(args, "server", None):
        flags["nats.servers"] = list(args.server)
    return {k: v for k, v in flags.items() if v is not None}


def flag_pins(args: argparse.Namespace) -> dict[str, str]:
    """key -> the flag that sets it, for each key the command line pins (SIGHUP cannot change them)."""
    names = {key: "--" + dest.replace("_", "-") for dest, key in FLAG_KEYS.items()} | {"nats.servers": "--server"}
    return {key: names[key] for key in flag_values(args)}


def from_args(args: argparse.Namespace, with_flags: bool = True) -> Config:
    """The config a command runs with: --config (or its fallbacks), the environment, the flags."""
    path = find_config_path(args.config, os.environ)
    return load(path, os.environ, flag_values(args) if with_flags else {})


def with_servers(cfg: Config, servers: tuple[str, ...]) -> Config:
    return dataclasses.replace(cfg, nats=dataclasses.replace(cfg.nats, servers=servers))


def client_config(cfg: Config) -> Config:
    """With no servers configured, talk to the embedded server `supervisor start` runs."""
    if cfg.nats.servers:
        return cfg
    return with_servers(cfg, (f"nats://{cfg.embedded.host}:{cfg.embedded.port}",))


def read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("--config", f"no such file: {path}") from None
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from None


def _overlay(raw: dict, sources: dict, data: Mapping[str, Any], source: str) -> None:
    for section, values in data.items():
        if section not in SECTIONS and section not in NAMED:
            raise ConfigError(f"[{section}]", "unknown section" + _suggest(section, [*SECTIONS, *NAMED]), source)
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}]", "must be a table of keys", source)
        if section in NAMED:
            for name, entry in values.items():
                _overlay_entry(raw.setdefault(section, {}), sources, section, name, entry, source)
            continue
        _overlay_keys(raw[section], sources, section, section, values, source)


def _overlay_entry(raw: dict, sources: dict, section: str, name: str, entry: Any, source: str) -> None:
    if not isinstance(entry, dict):
        raise ConfigError(f"{section}.{name}", f"must be a table: [{section}.{name}] with its keys", source)
    if not name or not set(name) <= NAME_CHARS:
        raise ConfigError(f"[{section}.{name}]", "a name takes letters, digits, _ and - only", source)
    _overlay_keys(raw.setdefault(name, {}), sources, section, f"{section}.{name}", entry, source)


def _overlay_keys(raw: dict, sources: dict, section: str, prefix: str, values: Mapping[str, Any], source: str) -> None:
    known = section_keys(section)
    for name, value in values.items():
        if f"{prefix}.{name}" in RETIRED:
            raise ConfigError(f"{prefix}.{name}", "no longer a key: " + RETIRED[f"{prefix}.{name}"], source)
        if name not in known:
            raise ConfigError(f"{prefix}.{name}", "unknown key" + _suggest(name, known, prefix), source)
        raw[name] = value
        sources[f"{prefix}.{name}"] = source


def _suggest(word: str, choices: typing.Iterable[str], section: str = "") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    if not close:
        return ""
    return f"; did you mean {section + '.' if section else ''}{close[0]}?"


def env_overrides(env: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """SUPERVISOR_<SECTION>_<KEY> for our sections only.

    Variables naming another section are left alone: supervisord, for one, sets
    SUPERVISOR_ENABLED and friends in its children, and we may well run under it.
    """
    out: dict[str, dict[str, Any]] = {}
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX) or var == ENV_CONFIG_PATH:
            continue
        rest = var[len(ENV_PREFIX):].lower()
        if any(rest.startswith(s + "_") for s in NAMED):
            raise ConfigError(var, "named sections ([schedules.NAME], [limits.NAME], [pools.NAME]) are set in "
                                   "the config file only", "environment")
        section = next((s for s in SECTIONS if rest.startswith(s + "_")), None)
        if section is None:
            continue
        name = rest[len(section) + 1:]
        if f"{section}.{name}" in RETIRED:
            raise ConfigError(var, "no longer a key: " + RETIRED[f"{section}.{name}"], "environment")
        if name not in section_keys(section):
            raise ConfigError(var, "unknown key" + _suggest(name, section_keys(section), section), "environment")
        secret = section_keys(section)[name].metadata["secret"]
        out.setdefault(section, {})[name] = parse_text(text, key_type(section, name), var, secret)
    return out


def parse_text(text: str, typ: Any, name: str, secret: bool = False) -> Any:
    """A string from the environment or a flag, read as the key's type."""
    try:
        if typ is bool:
            lowered = text.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            return int(text)
        if typ is float:
            return float(text)
        if typing.get_origin(typ) is tuple:
            stripped = text.strip()
            if stripped.startswith("["):
                return tomllib.loads(f"v = {stripped}")["v"]
            item = typing.get_args(typ)[0]
            return [parse_text(p.strip(), item, name) for p in stripped.split(",") if p.strip()]
        return text
    except (ValueError, tomllib.TOMLDecodeError):
        shown = "its value" if secret else repr(text)
        raise ConfigError(name, f"cannot read {shown} as {type_name(typ)}", "environment") from None
