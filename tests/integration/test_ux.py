"""Operator experience (issue 15): nothing lost by default, and a CLI that never misleads.

Real processes and a real nats-server where behaviour matters; the parser, the render code and
the reload comparison as units."""

import argparse
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import tomli_w
from harness import DEADLINE, REPO, child_env, publish, run_cli, wait_until
from natsauth import first_pick_taken, free_port

from supervisor import config
from supervisor.cli import main as cli
from supervisor.cli.render import render_status
from supervisor.errors import NatsUnavailable
from supervisor.nats import embedded
from supervisor.nats.embedded import STORE_LOCK, TEMP_PREFIX, EmbeddedServer, default_store_dir
from supervisor.parent.supervisor import overruled, user_frame


def error_line(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("supervisor: error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(tomli_w.dumps(cfg))
    return path


# ---------------------------------------------------------------- 1. the default store keeps jobs

def test_pending_jobs_survive_a_clean_restart_on_the_default_store(tmp_path, supervisor_factory):
    state = tmp_path / "state"
    env = {"XDG_STATE_HOME": str(state)}
    first = supervisor_factory(None, env=env, embedded={"store_dir": ""}, workers={"count": 1})
    s = first.wait_ready(1)
    store = state / "jetstream-supervisor"
    assert f"(store {store}" in first.log(), first.log()
    url = f"nats://{s['nats']['server']}"
    publish(url, count=20, data="0.1")
    wait_until(lambda: first.jobs.done(), what="the first jobs done")
    first.signal(signal.SIGTERM)
    assert first.wait() == 0
    left = 20 - len(first.jobs.done_seqs())
    assert left > 0, "the test needs jobs still waiting at the SIGTERM"

    second = supervisor_factory(None, env=env, embedded={"store_dir": ""}, workers={"count": 2})
    second.wait_ready(2)
    wait_until(lambda: first.jobs.done_seqs() | second.jobs.done_seqs() == set(range(1, 21)),
               what="every job published before the restart done")
    assert len(second.jobs.done_seqs()) >= left
    assert second.stop() == 0


def test_default_store_location():
    assert default_store_dir({"STATE_DIRECTORY": "/var/lib/js:/var/lib/other", "XDG_STATE_HOME": "/x"}) == \
        Path("/var/lib/js")
    assert default_store_dir({"XDG_STATE_HOME": "/x/state"}) == Path("/x/state/jetstream-supervisor")
    assert default_store_dir({"XDG_STATE_HOME": "relative"}) == Path.home() / ".local/state/jetstream-supervisor"
    assert default_store_dir({}) == Path.home() / ".local/state/jetstream-supervisor"


def test_memory_store_warns_and_is_gone_after_exit(tmp_path, supervisor_factory):
    temp = tmp_path / "tmp"
    temp.mkdir()
    sup = supervisor_factory(None, env={"TMPDIR": str(temp)}, embedded={"store_dir": ":memory:"}, workers={"count": 1})
    sup.wait_ready(1)
    assert "jobs still waiting when the supervisor stops are lost" in sup.log()
    [store] = list(temp.glob(TEMP_PREFIX + "*"))
    assert f"(store {store}" in sup.log()
    assert sup.stop() == 0
    assert not store.exists()


# ---------------------------------------------------------------- 12. no temp dir left on any failure

@pytest.fixture
def private_tempdir(tmp_path, monkeypatch):
    import tempfile

    where = tmp_path / "tmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    return where


def test_embedded_failures_leave_no_temp_dir(private_tempdir, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedServer("127.0.0.1", taken.getsockname()[1], 0, ":memory:")
        with pytest.raises(NatsUnavailable, match="embedded.port"):
            server.start(5)
    assert not list(private_tempdir.iterdir())

    monkeypatch.setattr("supervisor.nats.embedded.find_binary", lambda: "/bin/false")      # exits at once
    server = EmbeddedServer("127.0.0.1", 0, 0, ":memory:")
    with pytest.raises(NatsUnavailable, match="exited with code 1"):
        server.start(5)
    assert not list(private_tempdir.iterdir())


def test_a_picked_port_taken_before_the_server_binds_is_picked_again(tmp_path, monkeypatch):
    """embedded.port = 0: free_port() found a port free a moment ago, and any socket may take it
    before nats-server binds. The server exits "address already in use" (for real: the port is
    held here); the start picks another port instead of failing. The pre-start check is skipped
    to reach that window; a port the config names is still refused (test above)."""
    monkeypatch.setattr("supervisor.nats.embedded.check_port_free", lambda *args: None)
    with first_pick_taken(monkeypatch, embedded) as held:
        server = EmbeddedServer("127.0.0.1", 0, 0, str(tmp_path / "store"))
        assert server.port == held
        server.start(30)
        try:
            assert server.port != held
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                assert s.recv(4096).startswith(b"INFO ")
            assert b"address already in use" in (tmp_path / "store" / "nats-server.log").read_bytes()
        finally:
            server.stop()


def test_a_store_in_use_is_refused_and_the_refused_start_leaves_nothing(tmp_path, private_tempdir):
    store = tmp_path / "store"
    first = EmbeddedServer("127.0.0.1", 0, 0, str(store))
    first.start(30)
    try:
        second = EmbeddedServer("127.0.0.1", 0, 0, str(store))
        with pytest.raises(NatsUnavailable, match=f"embedded.store_dir {store} is in use"):
            second.start(30)
        assert second.proc is None
    finally:
        first.stop()
    memory = EmbeddedServer("127.0.0.1", first.port, 0, ":memory:")
    memory.start(30)
    try:
        again = EmbeddedServer("127.0.0.1", memory.port, 0, ":memory:")
        with pytest.raises(NatsUnavailable, match="embedded.port"):
            again.start(30)
        assert len(list(private_tempdir.iterdir())) == 1          # the running one's only
    finally:
        memory.stop()
    assert not list(private_tempdir.iterdir())


def fake_store(parent: Path, name: str, age: float) -> Path:
    store = parent / (TEMP_PREFIX + name)
    (store / "jetstream").mkdir(parents=True)
    (store / STORE_LOCK).write_text("")
    os.utime(store, (time.time() - age, time.time() - age))
    return store


def test_a_killed_supervisors_throw_away_store_is_removed_by_the_next(private_tempdir):
    """SIGKILL leaves no chance to clean up: the next throw-away start removes stores whose lock
    is free, and leaves a live supervisor's (lock held) and a just-made one (no lock yet) alone."""
    orphan = fake_store(private_tempdir, "orphan", 3600)
    young = fake_store(private_tempdir, "young", 0)
    live = fake_store(private_tempdir, "live", 3600)
    held = os.open(live / STORE_LOCK, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        server = EmbeddedServer("127.0.0.1", 0, 0, ":memory:")
        server.start(30)
        try:
            assert not orphan.exists() and young.exists() and live.exists()
        finally:
            server.stop()
    finally:
        os.close(held)
    assert {p.name for p in private_tempdir.iterdir()} == {young.name, live.name}
    for store in (young, live):
        shutil.rmtree(store)


# ---------------------------------------------------------------- 2. global flags anywhere

@pytest.mark.parametrize("argv", [
    ["--config", "a.toml", "--server", "nats://x:1", "--log-format", "json", "lag"],
    ["lag", "--config", "a.toml", "--server", "nats://x:1", "--log-format", "json"],
    ["--config", "a.toml", "lag", "--server", "nats://x:1", "--log-format", "json"],
])
def test_global_flags_before_or_after_the_command(argv):
    args = cli.parse(argv)
    assert (args.config, args.server, args.log_format, args.command) == ("a.toml", ["nats://x:1"], "json", "lag")
    assert not [k for k in vars(args) if k.startswith(cli.AFTER)]


def test_global_flags_on_nested_commands_and_servers_add_up():
    for argv in (["--config", "c", "config", "check"], ["config", "--config", "c", "check"],
                 ["config", "check", "--config", "c"], ["--config", "c", "dlq", "list"]):
        assert cli.parse(argv).config == "c", argv
    assert cli.parse(["--server", "nats://a:1", "lag", "--server", "nats://b:2"]).server == ["nats://a:1", "nats://b:2"]
    assert cli.parse(["config", "check"]).config is None


def test_config_before_the_command_is_honoured(tmp_path):
    (tmp_path / "config.toml").write_text("[workers]\nhandler = \"workers.examples:noop\"\n")   # the decoy
    (tmp_path / "bad.toml").write_text("[workers\n")
    r = run_cli("--config", "bad.toml", "config", "check", tmp=tmp_path)
    assert r.returncode == 2 and "bad.toml: not valid TOML" in error_line(r)
    r = run_cli("--config", "missing.toml", "config", "show", tmp=tmp_path)
    assert r.returncode == 2 and "no such file: missing.toml" in error_line(r)


def test_server_before_the_command_is_honoured(tmp_path):
    port = free_port()
    r = run_cli("--server", f"nats://127.0.0.1:{port}", "lag", tmp=tmp_path, timeout=20)
    assert r.returncode == 4 and f"127.0.0.1:{port}" in error_line(r)


# ---------------------------------------------------------------- 5. one-shot commands give up fast

def test_publish_to_a_closed_port_exits_4_at_once(tmp_path):
    """The config says startup_timeout 30 s: a one-shot command must not use it (the subprocess
    timeout of 20 s fails the test if it does)."""
    port = free_port()
    write_config(tmp_path / "config.toml", {"nats": {"startup_timeout": 30.0}})
    r = run_cli("publish", "--server", f"nats://127.0.0.1:{port}", tmp=tmp_path, timeout=20)
    assert r.returncode == 4 and f"127.0.0.1:{port}" in error_line(r)


def test_a_server_that_never_answers_is_given_up_after_connect_timeout(tmp_path):
    with socket.socket() as silent:            # accepts connections (the kernel does), says nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        for command in (("publish",), ("lag",), ("dlq", "list")):
            r = run_cli(*command, "--server", f"nats://127.0.0.1:{port}", tmp=tmp_path, timeout=20,
                        env={"SUPERVISOR_NATS_CONNECT_TIMEOUT": "0.5", "SUPERVISOR_NATS_STARTUP_TIMEOUT": "30"})
            line = error_line(r)
            assert r.returncode == 4 and f"127.0.0.1:{port}" in line, (command, line)


# ---------------------------------------------------------------- 6. a handler is required to start

def test_start_without_a_handler_exits_2_saying_what_to_write(tmp_path):
    r = run_cli("start", "--http", "", tmp=tmp_path)
    line = error_line(r)
    assert r.returncode == 2
    for words in ("workers.handler", "--handler myjobs:handle", 'handler = "myjobs:handle"',
                  "workers.examples:sleep_job"):
        assert words in line, line
    r = run_cli("config", "check", tmp=tmp_path)
    assert r.returncode == 2 and "workers.handler" in error_line(r)
    assert not (tmp_path / "state").exists() and not list(Path(os.environ["XDG_STATE_HOME"]).glob("*/supervisor.lock"))


def test_the_example_config_needs_only_a_handler(tmp_path):
    r = run_cli("config", "check", "--config", str(REPO / "config.toml"), tmp=tmp_path)
    assert r.returncode == 2 and "workers.handler" in error_line(r)
    r = run_cli("config", "check", "--config", str(REPO / "config.toml"), tmp=tmp_path,
                env={"SUPERVISOR_WORKERS_HANDLER": "workers.examples:sleep_job"})
    assert r.returncode == 0 and "handler workers.examples:sleep_job imports" in r.stdout, r.stderr


# ---------------------------------------------------------------- 9. import errors say where

BROKEN_SETTINGS = "import json\n\nSETTINGS = json.loads('{not json')\n"


def test_a_handler_failing_at_import_shows_file_and_line(tmp_path):
    (tmp_path / "settings_loader.py").write_text(BROKEN_SETTINGS)
    (tmp_path / "myjobs.py").write_text("from settings_loader import SETTINGS\n\n\ndef handle(job):\n    pass\n")
    r = run_cli("start", "--handler", "myjobs:handle", "--http", "", tmp=tmp_path)
    line = error_line(r)
    assert r.returncode == 3
    assert "cannot import 'myjobs': JSONDecodeError" in line, line
    assert "(at settings_loader.py:3: SETTINGS = json.loads('{not json'))" in line, line

    (tmp_path / "typo.py").write_text("def handle(job):\n    return job +\n")
    r = run_cli("start", "--handler", "typo:handle", "--http", "", tmp=tmp_path)
    assert r.returncode == 3 and "SyntaxError" in error_line(r) and "(at typo.py:2)" in error_line(r)


def test_user_frame_prefers_the_users_code_over_libraries_and_ours(tmp_path, monkeypatch):
    (tmp_path / "wrapped_jobs.py").write_text("import json\n\n\ndef load():\n    return json.loads('x')\n\n\n"
                                              "CONFIG = load()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as info:
        import wrapped_jobs  # noqa: F401
    where = user_frame(info.value, "wrapped_jobs")
    assert where.endswith("wrapped_jobs.py:5: return json.loads('x')"), where   # not json/decoder.py


def test_config_check_imports_the_handler(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('no database configured')\n")
    r = run_cli("config", "check", tmp=tmp_path, env={"SUPERVISOR_WORKERS_HANDLER": "broken:handle"})
    assert r.returncode == 3 and "no database configured" in error_line(r) and "broken.py:1" in error_line(r)
    r = run_cli("config", "check", tmp=tmp_path, env={"SUPERVISOR_WORKERS_HANDLER": "workers.examples:nope"})
    assert r.returncode == 3 and "has no attribute 'nope'" in error_line(r)
    r = run_cli("config", "check", tmp=tmp_path, env={"SUPERVISOR_WORKERS_HANDLER": "workers.examples:noop",
                                                      "SUPERVISOR_WORKERS_INIT": "broken:setup"})
    assert r.returncode == 3 and "workers.init" in error_line(r)


# ---------------------------------------------------------------- 8. process titles

def test_process_titles_name_the_parent_and_each_worker(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 2})
    s = sup.wait_ready(2)
    titles = {w["slot"]: " ".join(psutil.Process(w["pid"]).cmdline()).strip() for w in s["workers"]["list"]}
    assert titles == {0: "supervisor: worker 0 [JOBS/workers]", 1: "supervisor: worker 1 [JOBS/workers]"}
    parent = psutil.Process(sup.proc.pid)
    wait_until(lambda: " ".join(parent.cmdline()).strip() == "supervisor: parent [JOBS/workers] 2/2 ready",
               what="the parent's title")
    assert subprocess.run(["ps", "-o", "args=", "-p", str(s["workers"]["list"][0]["pid"])], capture_output=True,
                          text=True).stdout.startswith("supervisor: worker 0")
    assert sup.stop() == 0


# ---------------------------------------------------------------- 3/10. log lines say what they mean

def test_a_dead_worker_log_line_says_seq(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 1, "handler": "workers.examples:crash_on_marker"})
    sup.wait_ready(1)
    publish(nats_server.url, count=1, data="crash-once")
    sup.wait_log(r"worker 0 \(pid \d+\) died: exit code 13; held seq 1; NAKed 1")
    assert sup.stop() == 0


# ---------------------------------------------------------------- 4. SIGHUP and the flags that pin keys

def test_reload_logs_each_key_a_flag_overrules(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, args=("--workers", "2", "--handler", "testhandlers:record"),
                             workers={"count": 2})
    sup.wait_ready(2)
    cfg = dict(sup.config)
    cfg["workers"] = {**cfg["workers"], "count": 3, "handler": "workers.examples:noop"}
    sup.config_path.write_text(tomli_w.dumps(cfg))
    sup.signal(signal.SIGHUP)
    sup.wait_log(r"reload: workers\.count stays 2 \(set by --workers\); the config now says 3")
    sup.wait_log(r"reload: workers\.handler stays 'testhandlers:record' \(set by --handler\); the config now says "
                 r"'workers\.examples:noop'")
    assert sup.status()["workers"]["target"] == 2
    assert sup.stop() == 0


def test_overruled_lists_only_keys_whose_file_value_differs():
    pinned = config.Config().replace(workers={"count": 6, "handler": "a:b"})
    from_file = config.Config().replace(workers={"count": 3, "handler": "a:b"})
    pins = {"workers.count": "--workers", "workers.handler": "--handler"}
    assert overruled(pinned, from_file, pins) == [("workers.count", "--workers", 6, 3)]
    assert overruled(pinned, pinned, pins) == []


# ---------------------------------------------------------------- 10. help and the status lag line

def all_parsers(parser: argparse.ArgumentParser, name: str = "supervisor"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from all_parsers(p, f"{name} {sub}")


def test_every_option_has_help_and_every_command_examples():
    parsers = list(all_parsers(cli.build_parser()))
    assert len(parsers) == 20          # supervisor, 11 commands (pause and resume the latest), config
    #                                    init|show|check, dlq list|replay, schedule list|add|rm
    for name, p in parsers:
        for action in p._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)
        assert "example" in (p.epilog or ""), name
        text = p.format_help()
        assert "seed" not in text.lower(), name


def test_help_runs_and_shows_examples(tmp_path):
    r = run_cli("--help", tmp=tmp_path)
    assert r.returncode == 0 and "examples:" in r.stdout and "supervisor --server nats://nats-1:4222 lag" in r.stdout
    r = run_cli("lag", "--help", tmp=tmp_path)
    assert r.returncode == 0 and "ackPending   delivered and not yet acked" in r.stdout


def lag_status(lag: dict) -> str:
    return render_status({"consumer": {"stream": "JOBS", "name": "workers", "poll_age_s": 0.2, "num_pending": 10,
                                       "num_ack_pending": 3, "num_redelivered": 0, "delivered_consumer_seq": 30,
                                       "ack_floor_consumer_seq": 27}, "lag": lag})


def test_status_lag_line_shows_each_number_once_and_no_slope_while_draining():
    draining = lag_status({"state": "ok", "pending_slope_per_s": 3.9, "drain_rate_per_s": 4.0, "eta_s": 3.2,
                           "reason": "10 waiting, 3 in flight, finishing 4.0/s, empty in ~3 s"})
    [line] = [x for x in draining.splitlines() if x.startswith("lag ")]
    assert line == "lag         ok: 10 waiting, 3 in flight, finishing 4.0/s, empty in ~3 s", line
    growing = lag_status({"state": "growing", "pending_slope_per_s": 2.5, "drain_rate_per_s": 4.0, "eta_s": None,
                          "reason": "pending rose 0 -> 30 over 12 s (+2.5/s)"})
    [line] = [x for x in growing.splitlines() if x.startswith("lag ")]
    assert line == "lag         growing: pending rose 0 -> 30 over 12 s (+2.5/s); finishing 4.0/s, not draining", line
    catching_up = lag_status({"state": "growing", "pending_slope_per_s": 0.5, "drain_rate_per_s": 4.0, "eta_s": 40.0,
                              "reason": "pending rose 0 -> 30 over 60 s (+0.5/s)"})
    assert catching_up.count("empty in") == 1 and "eta" not in catching_up


# ---------------------------------------------------------------- 12. the demo keeps its own temp dir

def test_demo_leaves_its_temp_dir_nowhere(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    state = tmp_path / "state"
    r = subprocess.run([sys.executable, "-m", "supervisor", "demo", "--jobs", "6"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=DEADLINE,
                       env=child_env(TMPDIR=str(temp), XDG_STATE_HOME=str(state)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not list(temp.iterdir()) and not state.exists()


def test_config_error_is_not_a_traceback_for_an_unusable_store(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = run_cli("start", "--handler", "workers.examples:noop", "--http", "", tmp=tmp_path,
                env={"SUPERVISOR_EMBEDDED_STORE_DIR": str(blocker / "store"), "SUPERVISOR_EMBEDDED_PORT": "0",
                     "SUPERVISOR_EMBEDDED_MONITOR_PORT": "0"})
    assert r.returncode == 2 and "embedded.store_dir: cannot use" in error_line(r)

