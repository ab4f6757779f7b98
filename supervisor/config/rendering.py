"""TOML out of the config tree: `config init` (commented defaults) and `config show`."""

from __future__ import annotations

import dataclasses
from typing import Any

import tomli_w

from supervisor.config.keys import NAMED, SECTIONS, Config, as_dict, key_type, section_keys, table_type
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
        # A list of tables with entries follows the section as [[section.key]]; empty, it is `key = []`.
        tables = {k: raw[section].pop(k) for k in list(raw[section]) if table_type(key_type(section, k))
                  and raw[section][k]}
        lines += [f"[{section}]", *_keys(section, raw[section], redact, comments), ""]
        if comments:
            tables.update({k: [] for k in section_keys(section) if table_type(key_type(section, k)) and k not in tables})
        for name, entries in tables.items():
            lines += _tables(section, name, entries, raw[section], comments)
    for section, entries in ((s, raw.get(s, {})) for s in NAMED):
        for name, values in entries.items():
            values = {k: v for k, v in values.items() if v is not None}     # a pool's unset keys are inherited
            lines += [f"[{section}.{name}]", *_keys(section, values, redact, comments), ""]
        if comments and not entries:       # an example to copy, every key at its default
            example = POOL_EXAMPLE if section == "pools" else as_dict_entry(section)
            lines += [f"# [{section}.NAME]", *_keys(section, example, redact, comments, "# "), ""]
            if section == "pools":
                lines[-1:-1] = [POOL_NOTE]
    return "\n".join(lines)


# [pools.NAME]'s keys are [workers]' and [consumer]'s, unset by default: the example shows a few.
POOL_EXAMPLE = {"handler": "app.mail:send", "count": 2, "filter_subject": "jobs.email.>", "consumer": ""}
POOL_NOTE = ("# ... and any [workers] key, ack_wait, max_deliver, max_ack_pending, backoff of [consumer], or "
             "ordering_key ([ordering]'s key); unset keys are theirs.\n"
             "# No [pools.*]: one pool, `default`, of [workers] and [consumer] (README: Pools).")


def _tables(section: str, name: str, entries: list[dict[str, Any]], parent: dict[str, Any], comments: bool) -> list[str]:
    """A list-of-tables key ([[retry.rules]]): each entry, unset keys left out; with comments and
    none, one commented example whose unset keys show the section's value they fall back to."""
    cls = table_type(key_type(section, name))
    assert cls is not None, name
    fields, lines = {f.name: f for f in dataclasses.fields(cls)}, []
    shown = entries or ([{k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cls()).items()}]
                        if comments else [])
    lead = "" if entries else "# "
    for entry in shown:
        lines.append(f"{lead}[[{section}.{name}]]")
        for key, value in entry.items():
            if value is None:
                if entries or key not in parent:
                    continue
                value = parent[key]
            text = f"{lead}{key} = {_toml_value(list(value) if isinstance(value, tuple) else value)}"
            doc = fields[key].metadata["doc"]
            lines.append(f"{text.ljust(COMMENT_COLUMN - 1)} # {doc}" if comments and doc else text)
        lines.append("")
    return lines


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
