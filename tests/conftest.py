import os
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

for _dir in ("support", "handlers"):       # the suite's helpers and the handlers its workers run
    sys.path.insert(0, str(Path(__file__).parent / _dir))

import strays  # noqa: E402
from harness import NatsServer, SupervisorProc, base_config  # noqa: E402

# Every process the suite starts carries this variable (children inherit the environment), so at
# the end the suite can tell its own leftovers from other test runs on the same machine.
SESSION_MARK = "JSS_TEST_SESSION"
OUR_TEMP_DIRS = ("jetstream-supervisor-*", "jsbench-*")   # embedded.py's throw-away stores, bench workdirs
BYTECODE = ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")      # private_temp_and_state sets these for children
SETTLE = 10.0          # seconds the last teardowns get to finish killing what they started
# Set to a file's path, each test process appends a line per test to it: the xdist worker, the
# test's id, and when its setup started and its teardown ended (wall clock), so a run shows how
# busy each worker was and how long the tail after the others ran out is (tests/support/timeline.py).
TIMELINE = "JSS_TEST_TIMELINE"

# xdist hands tests out in collection order, one at a time (pyproject: --maxschedchunk 1), so the
# longest start first and the short ones fill the end: no worker is left running a long test
# while the others have nothing to do. The files by their tests' total time, most first (a run
# with JSS_TEST_TIMELINE set, then tests/support/timeline.py, measures them); the rest keep their
# order after these. Only the order changes: each test does what it did. A file not here yet
# (test_ordering.py, coming) is simply not moved.
LONG_FIRST = tuple(f"tests/integration/{name}.py" for name in (
    "test_bench_smoke", "test_observability", "test_found_by_random", "test_autoscale", "test_crash_safety",
    "test_chaos_fast", "test_reliability", "test_schedules", "test_fleet_cluster", "test_in_transit",
    "test_idempotency", "test_operations", "test_worker_edges", "test_bad_input", "test_parent_loop",
    "test_ordering", "test_chaos_random", "test_auth_e2e", "test_limits", "test_pools", "test_once",
    "test_promises_contract", "test_tracing", "test_limits_cluster", "test_status_cli_demo", "test_core",
    "test_fleet_release", "test_promises_delivery", "test_soak", "test_cluster_acks", "test_ux",
    "test_middleware")) + ("tests/unit/test_structure.py",)      # mypy and ruff: 10 s, last in collection
STRAYS_FILE = "strays.jsonl"      # tests/support/strays.py's record, in the session's shared temp dir
# Fixtures one test builds for the whole session while every other test that uses them waits on a
# lock (test_bench_smoke's `smoke`: 80 s and more). Its first user starts first (its file leads
# LONG_FIRST); the others go last, when it is long built, instead of holding workers idle on the lock.
BUILT_ONCE = ("smoke",)


def our_processes(mark: str, basetemp: Path) -> list[psutil.Process]:
    """Live processes (zombies excluded) this session started, the pytest process excluded: the
    session's mark in their environment, or a working directory in the session's temp tree (a
    supervisor's process title overwrites the memory /proc/PID/environ reads, so its workers
    are known by the directory the harness starts each supervisor in)."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(SESSION_MARK) == mark or Path(p.cwd()).is_relative_to(basetemp):
                found.append(p)
        except psutil.Error:
            pass
    return found


def describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline()).strip()[:200]}"
    except psutil.Error:
        return f"pid {p.pid} (gone)"


@pytest.hookimpl(trylast=True)          # after pytest groups tests by their fixtures' parameters
def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))     # stable: the rest keep their order
    for name in BUILT_ONCE:
        waiting = [item for item in items if name in item.fixturenames][1:]
        items[:] = [item for item in items if item not in waiting] + waiting


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(TIMELINE)
    began = time.time()
    yield
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(path, "a") as out:       # one short write per line: the workers' lines do not mix
            out.write(f"{worker} {began:.3f} {time.time():.3f} {item.nodeid}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Once the test's fixtures are torn down: what it left running (tests/support/strays.py)."""
    before = getattr(item, "_strays_before", None)
    tmp = (item.funcargs or {}).get("tmp_path")
    yield
    if before is not None:
        strays.outlived(item.nodeid, tmp, before)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """What runs before the test's body: a fixture of a wider scope (a database server kept for
    the module) starts its processes and threads in the setup of the first test that uses it."""
    item._strays_before = strays.Before()


def pytest_terminal_summary(terminalreporter, config):
    """Strays the session saw (F17): connections a test's server refused because they carried
    another test's credentials, and processes and threads a test left running."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    lines = strays.summary(config._tmp_path_factory.getbasetemp() / STRAYS_FILE)
    if lines:
        terminalreporter.write_sep("=", f"strays ({len(lines)})")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def private_temp_and_state(tmp_path_factory):
    """Every process the suite starts gets a temp dir and a state home of the session's own (no
    test writes into ~/.local/state) and a mark. At the end the session fails, naming them, if
    any nats-server, supervisor, worker or other process of ours still runs, or a temp store or
    bench workdir was left (other test runs on the machine use /tmp at the same time, so /tmp
    itself cannot tell)."""
    basetemp = tmp_path_factory.getbasetemp()
    root = tmp_path_factory.mktemp("session")
    mark = uuid.uuid4().hex
    saved = {k: os.environ.get(k) for k in ("TMPDIR", "XDG_STATE_HOME", "STATE_DIRECTORY", SESSION_MARK, *BYTECODE)}
    os.environ["TMPDIR"] = str(root / "tmp")
    os.environ["XDG_STATE_HOME"] = str(root / "state")
    os.environ.pop("STATE_DIRECTORY", None)
    # The Python processes the suite starts (hundreds of supervisors, CLI runs) keep their bytecode
    # in the session's temp tree, shared by the xdist workers: with PYTHONDONTWRITEBYTECODE set
    # (as on the project's machines) each compiled every module of ours from source at start,
    # 0.14 s of CPU a supervisor. Nothing is written into the source tree or the venv.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    shared = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    os.environ["PYTHONPYCACHEPREFIX"] = str(shared / "pycache")
    os.environ[SESSION_MARK] = mark
    # One record for every xdist worker, kept set past the session's end: the last test's teardown records too.
    os.environ[strays.RECORD] = str(shared / STRAYS_FILE)
    (root / "tmp").mkdir()
    try:
        yield root
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + SETTLE
    while (procs := our_processes(mark, basetemp)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [describe(p) for p in procs]
    for p in procs:                                          # named below; not left to run on
        try:
            p.kill()
        except psutil.Error:
            pass
    dirs = sorted(str(d) for pattern in OUR_TEMP_DIRS for d in (root / "tmp").glob(pattern))
    problems = [f"process left running: {x}" for x in left] + [f"temp dir left behind: {d}" for d in dirs]
    if problems:
        pytest.fail("the suite left things behind:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "store").start()
    yield server
    server.stop()


@pytest.fixture
def supervisor_factory(tmp_path):
    """Build (and always clean up) supervisors: factory(server, **sections) -> started SupervisorProc."""
    made = []

    def make(server, *, args=(), env=None, start=True, **sections):
        sub = tmp_path / f"sup{len(made)}"
        sub.mkdir()
        proc = SupervisorProc(sub, base_config(server, sub, **sections), args=args, env=env)
        made.append(proc)
        return proc.start() if start else proc

    yield make
    for proc in made:
        proc.cleanup()


@pytest.fixture
def nats_cluster(tmp_path):
    """A 3-node JetStream cluster on loopback (tests/support/natscluster.py), stopped after the test."""
    from natscluster import NatsCluster

    with NatsCluster(tmp_path / "cluster").start() as cluster:
        yield cluster
