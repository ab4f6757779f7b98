import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import NatsServer, SupervisorProc, base_config  # noqa: E402

OUR_TEMP_DIRS = "jetstream-supervisor-*"      # supervisor/embedded.py's throw-away stores


@pytest.fixture(scope="session", autouse=True)
def private_temp_and_state(tmp_path_factory):
    """Every process the suite starts gets a temp dir and a state home of the session's own: no
    test writes into ~/.local/state, and at the end the suite checks that no supervisor left a
    temp store behind (other test runs on the machine use /tmp at the same time, so /tmp itself
    cannot tell)."""
    root = tmp_path_factory.mktemp("session")
    saved = {k: os.environ.get(k) for k in ("TMPDIR", "XDG_STATE_HOME", "STATE_DIRECTORY")}
    os.environ["TMPDIR"] = str(root / "tmp")
    os.environ["XDG_STATE_HOME"] = str(root / "state")
    os.environ.pop("STATE_DIRECTORY", None)
    (root / "tmp").mkdir()
    yield root
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    left = sorted(p.name for p in (root / "tmp").glob(OUR_TEMP_DIRS))
    assert not left, f"temp stores left behind by the suite: {left}"


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
