"""Issue 22, R7: poison is decided by evidence. A worker death while several jobs ran blames none
of them: each is put on probation and run alone (workers/runtime/solo.py) until one kills a worker by
itself, so only that one is dead-lettered. A quarantine that fails keeps the job's evidence, and
its next fatal run tries again. Real nats-server, real supervisor, real SIGKILLs."""

from __future__ import annotations

import asyncio
import re

import nats
import pytest
import test_crash_safety
from harness import SupervisorProc, publish_now, wait_until

ACK_WAIT = 60.0
JSON_LOGS = ("--log-format", "json")


def dead_letters(url: str) -> list:
    return asyncio.run(test_crash_safety.dead_letters(url))


def all_deaths_logged(sup: SupervisorProc) -> list[dict]:
    """The worker_died events of every death the ledger has counted. A death is counted before
    its NAKs (or a poison job's TERM) go out and logged only after their fence
    (supervisor/parent/deaths.py settle), so the last line may follow what the test saw."""
    crashes = sup.status()["crosscheck"]["crashes"]

    def logged() -> list[dict] | None:
        died = sup.events("worker_died")
        return died if len(died) >= crashes else None
    return wait_until(logged, what=f"the {crashes} deaths counted all logged")


@pytest.mark.parametrize("handler", ["poisonhandlers:killer_async", "poisonhandlers:killer"])
def test_only_the_job_that_kills_is_quarantined_not_those_running_beside_it(nats_server, supervisor_factory,
                                                                            handler):
    """Review sketch A: one worker, concurrency 4; three 2 s jobs and one that SIGKILLs its worker
    0.3 s in start together. The first death blames none of the four; run alone, the killer
    kills by itself three times and is dead-lettered; the three others run alone and finish."""
    sup = supervisor_factory(nats_server, workers={"count": 1, "concurrency": 4, "handler": handler},
                             restart={"poison_after_crashes": 3}, consumer={"ack_wait": ACK_WAIT}, args=JSON_LOGS)
    sup.wait_ready(1)
    innocent = publish_now(nats_server.url, count=3, data="2")
    wait_until(lambda: {r.seq for r in sup.jobs.running()} == set(innocent), what="the three running")
    killer = publish_now(nats_server.url, count=1, data="kill-after:0.3")[0]     # starts beside them
    wait_until(lambda: nats_server.stream_msgs() == 0, timeout=ACK_WAIT / 2,
               what="the three done and the killer quarantined, long before AckWait")
    letters = dead_letters(nats_server.url)
    assert [int(m.headers["Supervisor-Dead-Letter-Sequence"]) for m in letters] == [killer]
    evidence = letters[0].headers["Supervisor-Dead-Letter-Deaths"]
    assert evidence.count("SIGKILL") == 3
    assert sup.jobs.done_seqs() == set(innocent)
    died = all_deaths_logged(sup)
    running_at = [sorted(r.seq for r in sup.jobs.running() if r.pid == d["worker_pid"]) for d in died]
    assert running_at[0] == sorted([*innocent, killer]), "all four ran at the first death"
    assert running_at[1:] == [[killer]] * 3, "then three deaths with the killer alone"
    assert [int(pid) for pid in re.findall(r"pid (\d+)", evidence)] == [d["worker_pid"] for d in died[1:]], \
        "blamed for the deaths it ran alone at, never for the first"
    status = sup.status()
    assert status["crosscheck"]["quarantined"] == 1
    assert sup.stop() == 0


def test_a_quarantine_that_fails_is_tried_again_at_the_next_fatal_run(nats_server, supervisor_factory):
    """Review sketch B: the dead-letter stream is gone when a job reaches poison_after_crashes
    deaths (max_deliver -1: the server would retry it for ever). The quarantine fails and the job
    is NAKed; the stream is back; the job's next fatal run quarantines it."""
    sup = supervisor_factory(nats_server, workers={"count": 1}, restart={"poison_after_crashes": 3},
                             consumer={"ack_wait": ACK_WAIT, "max_deliver": -1}, args=JSON_LOGS)
    sup.wait_ready(1)
    saved = asyncio.run(_drop_stream(nats_server.url, "JOBS_DLQ"))
    seq = publish_now(nats_server.url, count=1, data="crash")[0]
    sup.wait_log(rf"cannot quarantine poison job seq={seq}", timeout=ACK_WAIT / 2)
    asyncio.run(_make_stream(nats_server.url, saved))
    wait_until(lambda: nats_server.stream_msgs() == 0, timeout=ACK_WAIT / 2,
               what="the job quarantined at its next fatal run")
    letters = dead_letters(nats_server.url)
    assert [int(m.headers["Supervisor-Dead-Letter-Sequence"]) for m in letters] == [seq]
    assert sup.status()["crosscheck"]["quarantined"] == 1
    assert sup.stop() == 0


async def _drop_stream(url: str, name: str):
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        config = (await js.stream_info(name)).config
        await js.delete_stream(name)
        return config
    finally:
        await nc.close()


async def _make_stream(url: str, config) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(config)
    finally:
        await nc.close()
