"""Bad input gets its docs/CONTRACT.md exit code and one line that names the culprit, never a traceback."""

import socket

import pytest
import tomli_w
from harness import free_port, run_cli


def start(tmp_path, config: dict, *args: str, env: dict | None = None):
    config = {**config, "workers": {"handler": "workers.examples:noop", **config.get("workers", {})}}
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(config))
    return run_cli("start", "--config", str(path), *args, tmp=tmp_path, env=env)


def error_line(result) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("supervisor: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("config, words", [
    ({"workers": {"cuont": 3}}, ["workers.cuont", "unknown key", "did you mean workers.count"]),
    ({"worker": {"count": 3}}, ["[worker]", "unknown section", "did you mean workers"]),
    ({"workers": {"count": "eight"}}, ["workers.count", "expected an integer", "eight"]),
    ({"consumer": {"ack_wait": True}}, ["consumer.ack_wait", "expected a number"]),
    ({"workers": {"concurrency": 0}}, ["workers.concurrency", "at least 1"]),
    ({"log": {"format": "xml"}}, ["log.format", "text, json"]),
    ({"restart": {"dead_letter_subject": "jobs.dead"}}, ["restart.dead_letter_subject", "captured by stream.subjects"]),
    ({"monitor": {"http": "localhost"}}, ["monitor.http", "HOST:PORT"]),
    ({"nats": {"token_file": "/nonexistent/token"}}, ["nats.token_file", "/nonexistent/token"]),
    ({"workers": {"middleware": ["nocolon"]}}, ["workers.middleware", "expected MODULE:CLASS", "nocolon"]),
])
def test_config_errors_exit_2(tmp_path, config, words):
    result = start(tmp_path, config)
    assert result.returncode == 2
    line = error_line(result)
    for word in words:
        assert word in line, line
    assert "config.toml" in line or "nats." in line


def test_invalid_toml_names_the_file(tmp_path):
    (tmp_path / "config.toml").write_text("[workers\ncount = 1\n")
    result = run_cli("start", "--config", str(tmp_path / "config.toml"), tmp=tmp_path)
    assert result.returncode == 2 and "not valid TOML" in error_line(result)


def test_environment_overrides_are_checked(tmp_path):
    result = start(tmp_path, {}, env={"SUPERVISOR_WORKERS_COUNT": "many"})
    assert result.returncode == 2 and "SUPERVISOR_WORKERS_COUNT" in error_line(result)
    result = start(tmp_path, {}, env={"SUPERVISOR_WORKERS_CONUT": "2"})
    assert result.returncode == 2 and "did you mean workers.count" in error_line(result)


def test_bad_flag_is_a_usage_error(tmp_path):
    result = start(tmp_path, {}, "--workers", "x")
    assert result.returncode == 2 and "--workers" in error_line(result)


@pytest.mark.parametrize("handler, words", [
    ("no_such_module:run", ["workers.handler", "cannot import 'no_such_module'", "ModuleNotFoundError"]),
    ("testhandlers:missing", ["workers.handler", "has no attribute 'missing'"]),
    ("testhandlers:NOT_CALLABLE", ["workers.handler", "not callable"]),
])
def test_handler_that_does_not_import_exits_3(tmp_path, handler, words):
    result = start(tmp_path, {"workers": {"handler": handler}, "monitor": {"http": ""}})
    assert result.returncode == 3
    line = error_line(result)
    for word in words:
        assert word in line, line


@pytest.mark.parametrize("entry, handler, words", [
    ("no_such_module:M", "noop", ["workers.middleware[1]", "cannot import 'no_such_module'"]),
    ("testhandlers:record", "noop", ["workers.middleware[1]", "testhandlers:record is a function",
                                     "not a subclass of workers.Middleware"]),
    ("testmiddleware:NeedsArgs", "noop", ["workers.middleware[1]", "cannot be made with no arguments"]),
    ("testmiddleware:OuterAsync", "noop", ["workers.middleware[1]", "around is `async def`"]),
    ("testmiddleware:Outer", "testhandlers:record_async", ["workers.middleware[1]", "write `async def around`"]),
])
def test_middleware_that_does_not_import_or_fit_exits_3(tmp_path, entry, handler, words):
    handler = handler if ":" in handler else f"workers.examples:{handler}"
    result = start(tmp_path, {"workers": {"handler": handler, "middleware": ["testmiddleware:Inner", entry]},
                              "monitor": {"http": ""}})
    assert result.returncode == 3
    line = error_line(result)
    for word in words:
        assert word in line, line


def test_unreachable_server_exits_4(tmp_path):
    port = free_port()
    result = start(tmp_path, {"nats": {"servers": [f"nats://127.0.0.1:{port}"], "startup_timeout": 1.0},
                              "monitor": {"http": ""}})
    assert result.returncode == 4
    line = error_line(result)
    assert f"127.0.0.1:{port}" in line and "startup_timeout" in line


def test_embedded_port_in_use_exits_4(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = start(tmp_path, {"embedded": {"port": port, "monitor_port": 0}, "monitor": {"http": ""}})
    assert result.returncode == 4
    line = error_line(result)
    assert "embedded.port" in line and str(port) in line


def test_http_port_in_use_exits_2(tmp_path, nats_server):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = start(tmp_path, {"nats": {"servers": [nats_server.url]}, "monitor": {"http": f"127.0.0.1:{port}"}})
    assert result.returncode == 2
    assert "monitor.http" in error_line(result)


def test_crash_looping_workers_halt_with_exit_5(tmp_path, nats_server):
    result = start(tmp_path, {"nats": {"servers": [nats_server.url]}, "monitor": {"http": ""},
                              "workers": {"count": 2, "handler": "testhandlers:record", "init": "testhandlers:boom_init"},
                              "restart": {"backoff_initial": 0.01, "backoff_max": 0.05, "boot_failures_to_halt": 4}})
    assert result.returncode == 5
    line = error_line(result)
    assert "died before becoming ready" in line and "init hook failed" in line


def test_a_middleware_whose_setup_fails_halts_with_exit_5(tmp_path, nats_server):
    result = start(tmp_path, {"nats": {"servers": [nats_server.url]}, "monitor": {"http": ""},
                              "workers": {"count": 2, "handler": "testhandlers:record",
                                          "middleware": ["testmiddleware:SetupFails"]},
                              "restart": {"backoff_initial": 0.01, "backoff_max": 0.05, "boot_failures_to_halt": 4}})
    assert result.returncode == 5
    assert "died before becoming ready" in error_line(result) and "middleware's setup" in error_line(result)
    assert "workers.middleware raised RuntimeError: middleware setup failing on purpose" in result.stderr


def test_publish_to_a_subject_no_stream_captures_exits_4(tmp_path, nats_server):
    result = run_cli("publish", "--server", nats_server.url, "--subject", "elsewhere.x", "--count", "300", tmp=tmp_path)
    assert result.returncode == 4
    line = error_line(result)
    assert "elsewhere.x" in line and "no stream captures that subject" in line and "after 0 stored" in line
    assert "exception was never retrieved" not in result.stderr


def test_lag_without_the_consumer_exits_4(tmp_path, nats_server):
    result = run_cli("lag", "--server", nats_server.url, tmp=tmp_path)
    assert result.returncode == 4 and "consumer workers not found on stream JOBS" in error_line(result)
