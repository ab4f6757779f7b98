"""Unit tests for supervisor/config/keys.py: precedence, validation, error messages, rendering.

No network, no clocks; files live in tmp_path and the environment is always passed in.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from supervisor import config
from supervisor.config import Config, ConfigError, as_dict, load, parse_text, render
from supervisor.errors import EXIT_USAGE, SupervisorError

# The [section] key = default block of docs/CONTRACT.md (the contract), verbatim: more keys are allowed,
# these must exist with exactly these defaults, except the DEVIATIONS below.
SPEC_DEFAULTS = tomllib.loads("""
[nats]
servers = []
name = "jetstream-supervisor"
creds_file = ""
nkey_seed_file = ""
token_file = ""
user = ""
password_file = ""
tls_ca_file = ""
tls_cert_file = ""
tls_key_file = ""
startup_timeout = 30.0
[embedded]
host = "127.0.0.1"
port = 4222
monitor_port = 8222
store_dir = ""
[stream]
name = "JOBS"
subjects = ["jobs.>"]
create = true
storage = "file"
replicas = 1
retention = "workqueue"
duplicate_window = 120.0
[consumer]
name = "workers"
filter_subject = ""
ack_wait = 30.0
max_deliver = -1
max_ack_pending = 1000
backoff = []
[workers]
count = 4
handler = "workers.examples:sleep_job"
init = ""
concurrency = 1
batch = 16
job_timeout = 0.0
heartbeat_timeout = 30.0
max_jobs = 0
max_jobs_jitter = 0
max_rss_mb = 0
graceful_timeout = 30.0
double_ack = false
retry_backoff = [1.0, 5.0, 30.0]
[restart]
backoff_initial = 0.1
backoff_max = 30.0
boot_failures_to_halt = 10
poison_after_crashes = 3
dead_letter_subject = "dlq.jobs"
dead_letter_stream = "JOBS_DLQ"
[monitor]
interval = 1.0
lag_window = 60.0
http = "127.0.0.1:9520"
[log]
level = "info"
format = "text"
[nats]
connect_timeout = 2.0
[idempotency]
enabled = false
bucket = "JOBS_DONE"
ttl = 86400.0
[fleet]
name = ""
bucket = "SUPERVISOR_FLEET"
heartbeat = 2.0
[autoscale]
enabled = false
min = 1
max = 8
interval = 5.0
""".replace("[nats]\nconnect_timeout", "[nats_wave2]\nconnect_timeout"))
# Wave 2 added keys to [nats]; TOML forbids a table twice, so they are merged here.
SPEC_DEFAULTS["nats"].update(SPEC_DEFAULTS.pop("nats_wave2"))
# Defaults the second wave changed on purpose, each documented in the README: what docs/CONTRACT.md says, what
# ships, and why. Anything else that differs from the contract fails the test.
DEVIATIONS = {
    ("consumer", "max_deliver"): (-1, 10, "issue 15: a job that keeps failing ends in the dead letters"),
    ("workers", "handler"): ("workers.examples:sleep_job", "", "issue 15: `start` without a handler says so"),
    ("workers", "batch"): (16, 256, "issue 11: pulls are sized from the work; batch is only their ceiling"),
    ("workers", "retry_backoff"): ([1.0, 5.0, 30.0], [], "issue 24: [retry] replaces it (doubling, jitter); the "
                                                          "old list, when set, still gives the delays exactly"),
    ("autoscale", "interval"): (5.0, 1.0, "issue 25: a step every 4 s (one ConsumerInfo poll per decision), not 20 s"),
}


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load_text(tmp_path: Path, text: str, env=None, flags=None) -> Config:
    return load(write(tmp_path, text), env or {}, flags)


def config_error(fn, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return info.value


# ---------------------------------------------------------------- the tree and its defaults

def test_defaults_match_the_spec():
    actual = as_dict(Config())
    for section, keys in SPEC_DEFAULTS.items():
        for name, default in keys.items():
            assert name in actual[section], f"{section}.{name} missing"
            spec, shipped, _why = DEVIATIONS.get((section, name), (default, default, ""))
            assert spec == default, f"DEVIATIONS says the contract has {section}.{name} = {spec!r}; it has {default!r}"
            assert actual[section][name] == shipped, f"{section}.{name}"
            assert type(actual[section][name]) is type(default), f"{section}.{name} type"


def test_every_key_has_a_supported_type_and_valid_default():
    for section in config.SECTIONS:
        for name, f in config.section_keys(section).items():
            typ = config.key_type(section, name)
            assert config.keys.type_name(typ)           # raises KeyError for an unsupported type
            meta = f.metadata
            assert set(meta) >= {"doc", "lo", "hi", "choices", "secret"}
            value = getattr(getattr(Config(), section), name)
            # A default must satisfy its own declaration.
            config.keys._check_value(f"{section}.{name}", value, typ, meta, "")


def test_list_defaults_are_tuples_so_the_tree_is_hashable_and_frozen():
    cfg = Config()
    assert cfg.stream.subjects == ("jobs.>",)
    assert isinstance(cfg.workers.retry_backoff, tuple)
    hash(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workers.count = 9  # type: ignore[misc]


def test_config_error_is_a_usage_error():
    err = ConfigError("workers.count", "bad", "environment")
    assert isinstance(err, SupervisorError)
    assert err.exit_code == EXIT_USAGE == 2
    assert str(err) == "workers.count: bad (from environment)"
    assert str(ConfigError("x.y", "bad")) == "x.y: bad"


# ---------------------------------------------------------------- precedence

def test_no_file_no_env_no_flags_is_the_defaults():
    assert load(None, {}, None) == Config()
    assert load(None, {}, {}) == Config()


def test_precedence_defaults_file_env_flags(tmp_path):
    path = write(tmp_path, "[workers]\ncount = 5\nbatch = 3\nconcurrency = 2\n")
    env = {"SUPERVISOR_WORKERS_COUNT": "6", "SUPERVISOR_WORKERS_BATCH": "7"}
    cfg = load(path, env, {"workers.count": 8})
    assert cfg.workers.count == 8            # flag beats env beats file
    assert cfg.workers.batch == 7            # env beats file
    assert cfg.workers.concurrency == 2      # file beats default
    assert cfg.workers.max_jobs == 0         # default


def test_flags_with_none_do_not_override(tmp_path):
    cfg = load(write(tmp_path, "[log]\nformat = \"json\"\n"), {}, {"log.format": None, "workers.count": None})
    assert cfg.log.format == "json"
    assert cfg.workers.count == 4


def test_env_list_replaces_file_list(tmp_path):
    path = write(tmp_path, '[stream]\nsubjects = ["a.>", "b.>"]\n')
    cfg = load(path, {"SUPERVISOR_STREAM_SUBJECTS": "c.*"})
    assert cfg.stream.subjects == ("c.*",)


def test_flag_servers_list(tmp_path):
    cfg = load(None, {}, {"nats.servers": ["nats://a:4222", "nats://b:4222"]})
    assert cfg.nats.servers == ("nats://a:4222", "nats://b:4222")


def test_env_is_read_for_every_section():
    env = {"SUPERVISOR_NATS_NAME": "n", "SUPERVISOR_EMBEDDED_PORT": "0", "SUPERVISOR_STREAM_NAME": "S",
           "SUPERVISOR_CONSUMER_ACK_WAIT": "2.5", "SUPERVISOR_WORKERS_MAX_JOBS_JITTER": "3",
           "SUPERVISOR_RESTART_BACKOFF_MAX": "60", "SUPERVISOR_MONITOR_HTTP": "",
           "SUPERVISOR_LOG_LEVEL": "debug"}
    cfg = load(None, env)
    assert (cfg.nats.name, cfg.embedded.port, cfg.stream.name, cfg.consumer.ack_wait) == ("n", 0, "S", 2.5)
    assert (cfg.workers.max_jobs_jitter, cfg.restart.backoff_max, cfg.monitor.http) == (3, 60.0, "")
    assert cfg.log.level == "debug"


def test_env_of_other_programs_is_ignored():
    # supervisord sets these in its children; SUPERVISOR_CONFIG names our file, not a key.
    env = {"SUPERVISOR_ENABLED": "1", "SUPERVISOR_SERVER_URL": "unix:///tmp/supervisor.sock",
           "SUPERVISOR_PROCESS_NAME": "jobs", "SUPERVISOR_GROUP_NAME": "jobs",
           "SUPERVISOR_CONFIG": "/nonexistent.toml", "SUPERVISOR_LOGFILE": "x", "SUPERVISOR_": "",
           "WORKERS_COUNT": "x", "supervisor_workers_count": "x", "PATH": "/bin"}
    assert load(None, env) == Config()


def test_find_config_path_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config.find_config_path(None, {}) is None
    (tmp_path / "config.toml").write_text("")
    assert config.find_config_path(None, {}) == Path("config.toml")
    assert config.find_config_path(None, {"SUPERVISOR_CONFIG": "/etc/s.toml"}) == Path("/etc/s.toml")
    assert config.find_config_path("x.toml", {"SUPERVISOR_CONFIG": "/etc/s.toml"}) == Path("x.toml")
    assert config.find_config_path(None, {"SUPERVISOR_CONFIG": ""}) == Path("config.toml")


def test_replace_validates_and_keeps_the_original():
    cfg = Config()
    new = cfg.replace(workers={"count": 2}, log={"format": "json"})
    assert (new.workers.count, new.log.format) == (2, "json")
    assert cfg.workers.count == 4
    err = config_error(cfg.replace, workers={"count": -1})
    assert err.key == "workers.count" and err.source == "override"


# ---------------------------------------------------------------- unknown names

def test_unknown_section_suggests_the_nearest(tmp_path):
    path = write(tmp_path, "[worker]\ncount = 2\n")
    err = config_error(load, path, {})
    assert err.exit_code == 2
    assert "[worker]" in str(err) and "unknown section" in str(err)
    assert "did you mean workers?" in str(err)
    assert str(path) in str(err)


def test_unknown_key_suggests_the_nearest(tmp_path):
    err = config_error(load_text, tmp_path, "[workers]\ncout = 2\n")
    assert err.key == "workers.cout"
    assert "did you mean workers.count?" in str(err)


def test_unknown_key_without_any_near_name_has_no_suggestion(tmp_path):
    err = config_error(load_text, tmp_path, "[log]\nzzzzzzzz = 2\n")
    assert err.key == "log.zzzzzzzz"
    assert "did you mean" not in str(err)


def test_top_level_key_is_an_unknown_section(tmp_path):
    err = config_error(load_text, tmp_path, "count = 2\n")
    assert err.key == "[count]" and "unknown section" in err.problem


def test_section_that_is_not_a_table(tmp_path):
    err = config_error(load_text, tmp_path, "nats = 1\n")
    assert err.key == "[nats]" and "table" in err.problem


def test_unknown_env_key_in_a_known_section():
    err = config_error(load, None, {"SUPERVISOR_WORKERS_CONUT": "3"})
    assert err.key == "SUPERVISOR_WORKERS_CONUT"
    assert err.source == "environment"
    assert "did you mean workers.count?" in str(err)


# ---------------------------------------------------------------- file errors

def test_missing_file_names_the_path(tmp_path):
    err = config_error(load, tmp_path / "nope.toml", {})
    assert err.key == "--config" and "nope.toml" in str(err)


def test_unreadable_path_names_the_path(tmp_path):
    err = config_error(load, tmp_path, {})          # a directory
    assert err.key == "--config" and str(tmp_path) in str(err)


def test_invalid_toml_names_the_file(tmp_path):
    path = write(tmp_path, "[workers\ncount = 1\n")
    err = config_error(load, path, {})
    assert err.key == str(path) and "not valid TOML" in err.problem


def test_empty_file_is_the_defaults(tmp_path):
    assert load_text(tmp_path, "") == Config()


# ---------------------------------------------------------------- types and bounds

@pytest.mark.parametrize("text, key, expected", [
    ("[workers]\ncount = 4.0", "workers.count", "expected an integer, got a number (4.0)"),
    ("[workers]\ncount = \"4\"", "workers.count", "expected an integer, got a string ('4')"),
    ("[workers]\ncount = true", "workers.count", "expected an integer, got a boolean (True)"),
    ("[consumer]\nack_wait = \"30\"", "consumer.ack_wait", "expected a number (seconds)"),
    ("[consumer]\nack_wait = false", "consumer.ack_wait", "expected a number (seconds), got a boolean"),
    ("[consumer]\nack_wait = nan", "consumer.ack_wait", "expected a number (seconds)"),
    ("[consumer]\nack_wait = inf", "consumer.ack_wait", "expected a number (seconds)"),
    ("[workers]\ndouble_ack = 1", "workers.double_ack", "expected true or false, got an integer (1)"),
    ("[workers]\ndouble_ack = \"yes\"", "workers.double_ack", "expected true or false"),
    ("[stream]\nsubjects = \"jobs.>\"", "stream.subjects", "got a string"),
    ("[stream]\nsubjects = [1]", "stream.subjects", "expected a string, got an integer (1)"),
    ("[workers]\nretry_backoff = [1.0, \"x\"]", "workers.retry_backoff", "expected a number (seconds)"),
    ("[workers]\nretry_backoff = [1.0, true]", "workers.retry_backoff", "got a boolean"),
    ("[stream]\nname = 5", "stream.name", "expected a string, got an integer (5)"),
    ("[stream]\nname = {a = 1}", "stream.name", "expected a string, got a table"),
    ("[stream]\nname = [\"a\"]", "stream.name", "expected a string, got a list"),
])
def test_wrong_types_name_key_and_source(tmp_path, text, key, expected):
    path = write(tmp_path, text + "\n")
    err = config_error(load, path, {})
    assert err.key == key
    assert expected in err.problem
    assert err.source == str(path)
    assert str(path) in str(err)


def test_ints_are_accepted_for_floats_and_become_floats(tmp_path):
    cfg = load_text(tmp_path, "[consumer]\nack_wait = 5\nbackoff = [1, 2.5]\nmax_deliver = 5\n")
    assert cfg.consumer.ack_wait == 5.0 and type(cfg.consumer.ack_wait) is float
    assert cfg.consumer.backoff == (1.0, 2.5) and all(type(v) is float for v in cfg.consumer.backoff)


@pytest.mark.parametrize("dotted, value, ok", [
    ("embedded.port", 0, True), ("embedded.port", 65535, True),
    ("embedded.port", -1, False), ("embedded.port", 65536, False),
    ("embedded.monitor_port", -1, True), ("embedded.monitor_port", -2, False),
    ("stream.replicas", 1, True), ("stream.replicas", 5, True),
    ("stream.replicas", 0, False), ("stream.replicas", 6, False),
    ("consumer.ack_wait", 0.001, True), ("consumer.ack_wait", 0.0, False),
    ("consumer.max_deliver", -1, True), ("consumer.max_deliver", -2, False), ("consumer.max_deliver", 1, True),
    ("consumer.max_ack_pending", 0, False),
    ("workers.count", 0, True), ("workers.count", 1024, True), ("workers.count", 1025, False),
    ("workers.concurrency", 0, False), ("workers.batch", 4097, False),
    ("workers.heartbeat_timeout", 0.05, False), ("workers.job_timeout", -0.5, False),
    ("restart.backoff_initial", 0.0, True), ("restart.backoff_initial", -0.1, False),
    ("restart.boot_failures_to_halt", 0, False), ("restart.poison_after_crashes", 0, False),
    ("monitor.interval", 0.01, False), ("monitor.lag_window", 0.5, False),
    ("nats.startup_timeout", -1.0, False),
])
def test_bounds(tmp_path, dotted, value, ok):
    section, name = dotted.split(".")
    path = write(tmp_path, f"[{section}]\n{name} = {value!r}\n")
    if ok:
        assert getattr(getattr(load(path, {}), section), name) == value
    else:
        err = config_error(load, path, {})
        assert err.key == dotted
        assert "must be at" in err.problem and repr(value) in err.problem
        assert err.source == str(path)


@pytest.mark.parametrize("dotted, good, bad", [
    ("stream.storage", "memory", "disk"),
    ("stream.retention", "interest", "queue"),
    ("log.level", "warning", "warn"),
    ("log.format", "json", "JSON"),
])
def test_choices(tmp_path, dotted, good, bad):
    section, name = dotted.split(".")
    assert getattr(getattr(load_text(tmp_path, f'[{section}]\n{name} = "{good}"\n'), section), name) == good
    err = config_error(load_text, tmp_path, f'[{section}]\n{name} = "{bad}"\n')
    assert err.key == dotted and "must be one of" in err.problem and repr(bad) in err.problem


def test_bound_errors_name_the_source_of_env_and_flags():
    err = config_error(load, None, {"SUPERVISOR_WORKERS_COUNT": "-3"})
    assert (err.key, err.source) == ("workers.count", "environment")
    assert str(err).endswith("(from environment)")
    err = config_error(load, None, {}, {"workers.count": 5000})
    assert (err.key, err.source) == ("workers.count", "command line")
    err = config_error(load, None, {}, {"log.format": "xml"})
    assert (err.key, err.source) == ("log.format", "command line")


def test_a_later_layer_can_fix_an_earlier_bad_value(tmp_path):
    # Validation is of the merged result: a bad file value overridden by env is fine.
    path = write(tmp_path, "[workers]\ncount = -5\n")
    assert load(path, {"SUPERVISOR_WORKERS_COUNT": "2"}).workers.count == 2


def test_list_type_names_read_as_english(tmp_path):
    err = config_error(load_text, tmp_path, '[stream]\nsubjects = "jobs.>"\n')
    assert "a list of strings" in err.problem
    err = config_error(load_text, tmp_path, '[workers]\nretry_backoff = 1.0\n')
    assert "a list of numbers" in err.problem


@pytest.mark.parametrize("source", ["file", "env", "flag"])
def test_type_errors_on_secret_keys_do_not_print_the_secret(tmp_path, source):
    url = "nats://alice:hunter2@nats.example:4222"
    if source == "file":
        err = config_error(load_text, tmp_path, f'[nats]\nservers = "{url}"\n')
    elif source == "env":
        err = config_error(load, None, {"SUPERVISOR_NATS_SERVERS": f"[{url}]"})   # not valid TOML: unquoted
    else:
        err = config_error(load, None, {}, {"nats.servers": url})
    assert err.key in ("nats.servers", "SUPERVISOR_NATS_SERVERS")
    assert "hunter2" not in str(err)


# ---------------------------------------------------------------- parse_text (env strings)

@pytest.mark.parametrize("text", ["1", "true", "TRUE", "yes", "On", " true "])
def test_parse_text_true(text):
    assert parse_text(text, bool, "V") is True


@pytest.mark.parametrize("text", ["0", "false", "False", "no", "OFF"])
def test_parse_text_false(text):
    assert parse_text(text, bool, "V") is False


@pytest.mark.parametrize("text, typ", [("maybe", bool), ("", bool), ("2", bool), ("1.5", int), ("", int),
                                       ("x", int), ("0x10", int), ("", float), ("1s", float),
                                       ("[1, 2", tuple[float, ...]), ("[1, 2] x", tuple[float, ...])])
def test_parse_text_rejects(text, typ):
    err = config_error(parse_text, text, typ, "SUPERVISOR_X_Y")
    assert err.key == "SUPERVISOR_X_Y" and err.source == "environment"
    assert repr(text) in err.problem


def test_parse_text_scalars():
    assert parse_text(" 12 ", int, "V") == 12
    assert parse_text("-1", int, "V") == -1
    assert parse_text("2.5", float, "V") == 2.5
    assert parse_text("3", float, "V") == 3.0
    assert parse_text("  keep  spaces ", str, "V") == "  keep  spaces "
    assert parse_text("", str, "V") == ""


def test_parse_text_lists():
    strs = tuple[str, ...]
    assert parse_text('["a.>", "b"]', strs, "V") == ["a.>", "b"]
    assert parse_text("  [1, 2.5]", tuple[float, ...], "V") == [1, 2.5]
    assert parse_text("a.>, b.* ,c", strs, "V") == ["a.>", "b.*", "c"]
    assert parse_text("nats://h1:4222", strs, "V") == ["nats://h1:4222"]
    assert parse_text("", strs, "V") == []
    assert parse_text(" , ,", strs, "V") == []
    assert parse_text("[]", strs, "V") == []


def test_env_lists_end_to_end():
    cfg = load(None, {"SUPERVISOR_NATS_SERVERS": "nats://a:4222,nats://b:4222",
                      "SUPERVISOR_WORKERS_RETRY_BACKOFF": "[0.5, 2]",
                      "SUPERVISOR_CONSUMER_BACKOFF": "[]"})
    assert cfg.nats.servers == ("nats://a:4222", "nats://b:4222")
    assert cfg.workers.retry_backoff == (0.5, 2.0)
    assert cfg.consumer.backoff == ()


def test_env_comma_separated_numbers():
    cfg = load(None, {"SUPERVISOR_WORKERS_RETRY_BACKOFF": "0.5, 2, 10"})
    assert cfg.workers.retry_backoff == (0.5, 2.0, 10.0)


def test_env_scalar_errors_name_the_variable():
    err = config_error(load, None, {"SUPERVISOR_WORKERS_COUNT": "four"})
    assert err.key == "SUPERVISOR_WORKERS_COUNT" and err.source == "environment"
    assert "an integer" in err.problem
    err = config_error(load, None, {"SUPERVISOR_WORKERS_DOUBLE_ACK": "sure"})
    assert "true or false" in err.problem
    err = config_error(load, None, {"SUPERVISOR_CONSUMER_ACK_WAIT": "nan"})
    assert err.key == "consumer.ack_wait"                    # parsed, then rejected as not finite


def test_env_bool_and_float():
    cfg = load(None, {"SUPERVISOR_WORKERS_DOUBLE_ACK": "yes", "SUPERVISOR_STREAM_CREATE": "0",
                      "SUPERVISOR_WORKERS_JOB_TIMEOUT": "1.5"})
    assert cfg.workers.double_ack is True and cfg.stream.create is False and cfg.workers.job_timeout == 1.5


# ---------------------------------------------------------------- rules across keys

@pytest.mark.parametrize("text, key, words", [
    ('[workers]\nhandler = "mod.func"', "workers.handler", "MODULE:FUNCTION"),
    ('[workers]\nhandler = "a:b:c"', "workers.handler", "MODULE:FUNCTION"),
    ('[workers]\nhandler = ":f"', "workers.handler", "MODULE:FUNCTION"),
    ('[workers]\nhandler = "m:"', "workers.handler", "MODULE:FUNCTION"),
    ('[workers]\ninit = "setup"', "workers.init", "MODULE:FUNCTION"),
    ('[stream]\nsubjects = []', "stream.subjects", "at least one subject"),
    ('[restart]\nbackoff_initial = 5.0\nbackoff_max = 1.0', "restart.backoff_max", "restart.backoff_initial"),
    ('[restart]\nbackoff_initial = 60.0', "restart.backoff_max", ">= restart.backoff_initial"),
    ('[consumer]\nbackoff = [1.0, 2.0]\nmax_deliver = 2', "consumer.backoff", "max_deliver"),
    ('[consumer]\nmax_deliver = 0', "consumer.max_deliver", "-1"),
    ('[workers]\nretry_backoff = [1.0, -1.0]', "workers.retry_backoff", "negative"),
    ('[restart]\ndead_letter_subject = "jobs.dead"', "restart.dead_letter_subject", "captured by stream.subjects"),
    ('[stream]\nsubjects = ["*.jobs"]\n[restart]\ndead_letter_subject = "dlq.jobs"', "restart.dead_letter_subject",
     "captured"),
    ('[monitor]\nhttp = "localhost"', "monitor.http", "HOST:PORT"),
    ('[monitor]\nhttp = "localhost:http"', "monitor.http", "HOST:PORT"),
    ('[monitor]\nhttp = "localhost:70000"', "monitor.http", "HOST:PORT"),
    ('[nats]\ntls_cert_file = "c.pem"', "nats.tls_cert_file", "nats.tls_key_file"),
    ('[nats]\ntls_key_file = "k.pem"', "nats.tls_key_file", "nats.tls_cert_file"),
    ('[nats]\npassword_file = "p"', "nats.password_file", "nats.user"),
    ('[nats]\nservers = [""]', "nats.servers", "URL"),
    ('[nats]\nservers = ["nats://a:4222", "nats://b :4222"]', "nats.servers", "URL"),
])
def test_cross_key_rules(tmp_path, text, key, words):
    path = write(tmp_path, text + "\n")
    err = config_error(load, path, {})
    assert err.key == key
    assert words in err.problem
    assert err.exit_code == 2


@pytest.mark.parametrize("text", [
    '[consumer]\nbackoff = [1.0, 2.0]\nmax_deliver = 3',
    '[consumer]\nbackoff = [1.0, 2.0]\nmax_deliver = -1',
    '[restart]\ndead_letter_subject = ""',
    '[restart]\ndead_letter_subject = "jobs"',            # "jobs.>" needs at least one more token
    '[monitor]\nhttp = ""',
    '[monitor]\nhttp = "[::1]:0"',
    '[monitor]\nhttp = ":9520"',
    '[nats]\ntls_cert_file = "c.pem"\ntls_key_file = "k.pem"',
    '[nats]\nuser = "u"\npassword_file = "p"',
    '[nats]\nuser = "u"',
    '[restart]\nbackoff_initial = 0.0\nbackoff_max = 0.0',
    '[workers]\nhandler = "a.b.c:d"\ninit = "x:y"',
])
def test_cross_key_rules_accept(tmp_path, text):
    load_text(tmp_path, text + "\n")


def test_cross_key_error_names_the_source_of_the_offending_key(tmp_path):
    err = config_error(load, None, {"SUPERVISOR_NATS_TLS_KEY_FILE": "k.pem"})
    assert (err.key, err.source) == ("nats.tls_key_file", "environment")
    err = config_error(load, None, {}, {"monitor.http": "nope"})
    assert (err.key, err.source) == ("monitor.http", "command line")


@pytest.mark.parametrize("pattern, subject, match", [
    ("jobs.>", "jobs.a", True), ("jobs.>", "jobs.a.b", True), ("jobs.>", "jobs", False),
    ("jobs.*", "jobs.a", True), ("jobs.*", "jobs.a.b", False), ("*.a", "x.a", True),
    ("jobs", "jobs", True), ("jobs", "jobs.a", False), ("a.b", "a.c", False), (">", "x", True),
    ("a.*.c", "a.b.c", True), ("a.*.c", "a.b", False),
])
def test_subject_matches(pattern, subject, match):
    assert config.subject_matches(pattern, subject) is match


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:9520", ("127.0.0.1", 9520)), ("[::1]:80", ("::1", 80)), (":8080", ("127.0.0.1", 8080)),
    ("0.0.0.0:0", ("0.0.0.0", 0)), ("host:65535", ("host", 65535)),
])
def test_parse_hostport(text, expected):
    assert config.parse_hostport(text, "--http") == expected


@pytest.mark.parametrize("text", ["host", "host:", "host:-1", "host:65536", "host:8o", ""])
def test_parse_hostport_rejects(text):
    err = config_error(config.parse_hostport, text, "--http", "command line")
    assert err.key == "--http" and err.source == "command line"


# ---------------------------------------------------------------- rendering

def test_render_defaults_round_trips_through_tomllib():
    for comments in (True, False):
        text = render(Config(), comments=comments)
        assert tomllib.loads(text) == as_dict(Config())


def test_config_init_output_loads_as_the_defaults(tmp_path):
    path = write(tmp_path, render(Config(), redact=False, comments=True))
    assert load(path, {}) == Config()


def test_config_init_command_writes_the_defaults_and_never_overwrites_unasked(tmp_path):
    from harness import run_cli

    r = run_cli("config", "init", tmp=tmp_path)
    assert r.returncode == 0 and "set workers.handler" in r.stdout, r.stdout + r.stderr
    written = tmp_path / "config.toml"
    assert load(written, {}) == Config() and "# " in written.read_text()     # every key, commented
    written.write_text("[workers]\ncount = 3\n")                            # the operator's edits
    r = run_cli("config", "init", tmp=tmp_path)
    assert r.returncode == EXIT_USAGE and "exists; pass --force to overwrite it" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and written.read_text() == "[workers]\ncount = 3\n"
    r = run_cli("config", "init", str(tmp_path / "etc" / "c.toml"), tmp=tmp_path)
    assert r.returncode == EXIT_USAGE and "Traceback" not in r.stderr, r.stderr
    assert f"cannot write {tmp_path / 'etc' / 'c.toml'}: No such file or directory" in r.stderr, r.stderr
    assert run_cli("config", "init", "--force", tmp=tmp_path).returncode == 0
    assert load(written, {}) == Config()


def test_render_names_every_key_with_its_comment():
    text = render(Config(), comments=True)
    blocks = dict(re.findall(r"^\[(\w+)\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S))
    assert list(blocks) == list(config.SECTIONS)
    for section in config.SECTIONS:
        lines = blocks[section].splitlines()
        for name, f in config.section_keys(section).items():
            line = next(ln for ln in lines if ln.startswith(f"{name} = "))
            if f.metadata["doc"]:
                assert line.endswith("# " + f.metadata["doc"])
    plain = render(Config(), comments=False)
    assert not any(ln.lstrip().startswith("#") or " # " in ln for ln in plain.splitlines())


def test_render_a_non_default_config_round_trips(tmp_path):
    cfg = Config().replace(
        nats={"servers": ["nats://a:4222", "tls://b.example:4443"], "name": 'quote " and \\ and ünïcode',
              "user": "bob", "password_file": "/run/secrets/pw", "startup_timeout": 0.001},
        embedded={"port": 0, "monitor_port": -1, "store_dir": "/var/lib/x y"},
        stream={"subjects": ["a.>", "b.*.c"], "create": False, "storage": "memory", "duplicate_window": 1e-7},
        consumer={"backoff": [0.5, 1.0, 120.0], "max_deliver": 10, "ack_wait": 1e6},
        workers={"count": 0, "handler": "pkg.mod:func", "init": "pkg:init", "double_ack": True,
                 "retry_backoff": [], "job_timeout": 12.25},
        restart={"dead_letter_subject": "", "dead_letter_stream": ""},
        monitor={"http": ""},
        log={"level": "debug", "format": "json"},
    )
    for comments in (True, False):
        text = render(cfg, redact=False, comments=comments)
        assert tomllib.loads(text) == as_dict(cfg)
        assert load(write(tmp_path, text), {}) == cfg


def test_render_redacts_credentials_in_server_urls():
    cfg = Config().replace(nats={"servers": ["nats://alice:s3cr3t@h1:4222", "nats://t0k3n@h2:4222",
                                             "tls://h3:4443"]})
    shown = render(cfg)                          # config show: redact by default
    assert "s3cr3t" not in shown and "t0k3n" not in shown and "alice" not in shown
    assert tomllib.loads(shown)["nats"]["servers"] == ["nats://h1:4222", "nats://h2:4222", "tls://h3:4443"]
    assert "s3cr3t" in render(cfg, redact=False)


@pytest.mark.parametrize("url, shown", [
    ("nats://alice:p@ss:w0rd@h1:4222", "nats://h1:4222"),       # '@' and ':' inside the password
    ("nats://alice:pw?x#y@h1:4222", "nats://h1:4222"),
    ("alice:pw@h1:4222", "h1:4222"),                             # no scheme
    ("tls://h1:4443", "tls://h1:4443"),
])
def test_render_redacts_awkward_userinfo(url, shown):
    out = render(Config().replace(nats={"servers": [url]}))
    assert tomllib.loads(out)["nats"]["servers"] == [shown]


def test_render_redacts_a_password_with_a_slash():
    out = render(Config().replace(nats={"servers": ["nats://alice:k9/Zq+w==@h1:4222"]}))
    assert "k9" not in out and "Zq" not in out


def test_render_leaves_non_secret_keys_alone():
    cfg = Config().replace(nats={"user": "alice@example", "password_file": "/p"},
                           stream={"name": "user:pass@x"})
    parsed = tomllib.loads(render(cfg))
    assert parsed["nats"]["user"] == "alice@example"
    assert parsed["stream"]["name"] == "user:pass@x"
