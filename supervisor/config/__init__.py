"""The config: one tree of keys declared once (keys.py), loaded (loading.py), rendered (rendering.py),
diffed for SIGHUP (reload.py). This face is what the rest of the code imports."""

from supervisor.config.keys import (
    LIVE,
    REPLACE,
    RESTART,
    SECTIONS,
    Config,
    ConsumerConfig,
    NatsConfig,
    WorkersConfig,
    as_dict,
    key_type,
    section_keys,
)
from supervisor.config.loading import (
    FLAG_KEYS,
    client_config,
    find_config_path,
    flag_pins,
    flag_values,
    from_args,
    load,
    parse_text,
    with_servers,
)
from supervisor.config.rendering import render
from supervisor.config.subjects import parse_hostport, subject_matches, valid_subject
from supervisor.errors import ConfigError

__all__ = ["LIVE", "REPLACE", "RESTART", "SECTIONS", "Config", "ConsumerConfig", "NatsConfig", "WorkersConfig",
           "as_dict", "key_type", "section_keys", "FLAG_KEYS", "client_config", "find_config_path", "flag_pins",
           "flag_values", "from_args", "load", "parse_text", "with_servers", "render", "parse_hostport",
           "subject_matches", "valid_subject", "ConfigError"]
