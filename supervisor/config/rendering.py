"""TOML out of the config tree: `config init` (commented defaults) and `config show`."""

from __future__ import annotations

import dataclasses
from typing import Any

import tomli_w

from supervisor.config.keys import NAMED, SECTIONS, Config, as_dict, section_keys
from supervisor.config.secrets import redact_url

HEADER = """\
# jetstream-supervisor configuration (`supervisor config init` writes this file).
# Precedence: built-in defaults < this file < SUPERVISOR_<SECTION>_<KEY> environment
# variables (e.g. SUPERVISOR_WORKERS_COUNT=8) < command-line flags. Durations are seconds.
# Secrets are read from the *_file paths (relative ones from $CREDENTIALS_DIRECTORY under
# systemd), never given inline. `supervisor config check` validates, `config show` prints
# the effective configuration with secrets redacted.
"""
COMMENT_COLUMN = 34


def render(cfg: Config, *, redact: bool = True, comments: bool = True) -> str:
    """TOML for `config init` (commented defaults) and `config show` (effective, redacted)."""
    lines: list[str] = [HEADER] if comments else []
    raw = as_dict(cfg)
    for section in SECTIONS:
        lines += [f"[{section}]", *_keys(section, raw[section], redact, comments), ""]
    for section, entries in ((s, raw.get(s, {})) for s in NAMED):
        for name, values in entries.items():
            lines += [f"[{section}.{name}]", *_keys(section, values, redact, comments), ""]
        if comments and not entries:       # an example to copy, every key at its default
            lines += [f"# [{section}.NAME]", *_keys(section, as_dict_entry(section), redact, comments, "# "), ""]
    return "\n".join(lines)


def as_dict_entry(section: str) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(NAMED[section]()).items()}


def _keys(section: str, values: dict[str, Any], redact: bool, comments: bool, lead: str = "") -> list[str]:
    fields, out = section_keys(section), []
    for name, value in values.items():
        if redact and fields[name].metadata["secret"]:
            value = [redact_url(v) for v in value] if isinstance(value, list) else redact_url(value)
        text = f"{lead}{name} = {_toml_value(value)}"
        doc = fields[name].metadata["doc"]
        if comments and doc:
            text = f"{text.ljust(COMMENT_COLUMN - 1)} # {doc}"
        out.append(text)
    return out


def _toml_value(value: Any) -> str:
    """One-line TOML for a value (tomli-w breaks arrays over lines)."""
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).strip()[len("v = "):]
