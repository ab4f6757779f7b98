import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import NatsServer, SupervisorProc, base_config  # noqa: E402


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
