"""A dead worker's [limits] slots, released by its parent (supervisor/parent/crew.py
Crew.release_slots) with a fake NATS: tried again while NATS fails it, until the slots' lease
would have freed them anyway. Seed 1102 (batch 7): the parent's link was cut when the worker
holding a concurrency-1 slot died; its one try failed, and nothing limited ran for a whole
lease after the link was back. The real-server side:
tests/integration/test_found_by_random.py::test_a_dead_workers_limit_slot_is_released_once_its_parents_link_is_back."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from supervisor.config import Config
from supervisor.parent import crew as crew_mod
from supervisor.parent.crew import Crew


def release(monkeypatch, outcomes: list, lease: float = 5.0, reused: bool = False) -> tuple[list, SimpleNamespace]:
    """Run release_slots against a link whose state and answers follow `outcomes`, one per
    look: "down" (not connected), an exception (NATS failed the try) or "ok"; `reused`: the
    dead worker's pid is a process again."""
    tries: list = []
    nc = SimpleNamespace(is_connected=False)
    left = list(outcomes)

    async def release_worker(_nc, _cfg, pid: int, slot: int) -> list:
        tries.append((pid, slot))
        outcome = left.pop(0) if left else "ok"
        if isinstance(outcome, Exception):
            raise outcome
        return ["one slot 0"]

    async def look() -> None:                   # the link's state before each try
        while left and left[0] == "down":
            nc.is_connected = False
            left.pop(0)
            await asyncio.sleep(0.01)
        nc.is_connected = True

    async def run() -> None:
        watcher = asyncio.ensure_future(look())
        await Crew.release_slots(SimpleNamespace(nc=nc, cfg=Config()), 42, 3)   # type: ignore[arg-type]
        watcher.cancel()
    monkeypatch.setattr(crew_mod.limits, "release_worker", release_worker)
    monkeypatch.setattr(crew_mod.limits, "LEASE_TTL", lease)
    monkeypatch.setattr(crew_mod, "RELEASE_RETRY", 0.01, raising=False)
    monkeypatch.setattr(crew_mod.psutil, "pid_exists", lambda pid: reused)
    asyncio.run(run())
    return tries, nc


def test_a_release_is_tried_again_once_nats_is_back_and_after_a_failure(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="supervisor"):
        tries, _ = release(monkeypatch, ["down", "down", TimeoutError("nats: timeout"), "ok"])
    assert tries == [(42, 3), (42, 3)]           # none while the link was down; again after the timeout
    assert not [r for r in caplog.records if getattr(r, "event", "") == "limit_release_failed"]


def test_a_release_that_never_goes_through_gives_up_when_the_lease_has_run_out(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="supervisor"):
        tries, _ = release(monkeypatch, [RuntimeError("purge refused")] * 10_000, lease=0.2)
    assert 1 < len(tries) < 100
    [failed] = [r for r in caplog.records if getattr(r, "event", "") == "limit_release_failed"]
    assert "purge refused" in failed.getMessage()


def test_a_release_stops_once_the_dead_workers_pid_is_a_process_again(monkeypatch, caplog):
    """The slots are told apart by host, supervisor pid and worker pid; the OS reuses pids. Once
    the pid is a process again (a new worker of ours, say, that may take a slot) a retry could
    purge its slot: the release stops there, and the lease frees the dead worker's."""
    with caplog.at_level(logging.WARNING, logger="supervisor"):
        tries, _ = release(monkeypatch, [TimeoutError("nats: timeout")] * 5, reused=True)
    assert tries == []
    [failed] = [r for r in caplog.records if getattr(r, "event", "") == "limit_release_failed"]
    assert "pid 42 is another process's now" in failed.getMessage()
