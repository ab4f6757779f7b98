"""[idempotency] (workers/middleware/guard.py) and the publish side: the stream dedupes a Nats-Msg-Id within its
duplicate window; past it, the KV done-marker makes workers ack the job without running it; a lease
keeps two live workers from running one key at once; a bucket that does not answer never lets a
job run unguarded. Against a real nats-server; the guard's pure parts also by themselves."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import tomllib

import nats
import pytest
import tomli_w
from harness import publish, run_cli, wait_until
from nats.js import api
from nats.js.errors import NotFoundError

from workers import Job
from workers.middleware import guard as guard_mod
from workers.middleware.guard import DUPLICATE, RETRY, RUN, Guard, Holder, judge, kv_key, retry_after, this_process


async def js_call(url, fn):
    nc = await nats.connect(url)
    try:
        return await fn(nc.jetstream())
    finally:
        await nc.close()


# ---------------------------------------------------------------- the guard's pure parts

def test_kv_key_keeps_readable_ids_and_escapes_the_rest_unambiguously():
    assert kv_key("order-17") == "order-17"
    assert kv_key("JOBS:42") == "JOBS=3A42"
    assert kv_key("a.b") == "a=2Eb" and kv_key("a=2Eb") == "a=3D2Eb"     # '=' itself is escaped
    assert kv_key("café 1") == "caf=C3=A9=201"
    assert re.fullmatch(r"[-/_=a-zA-Z0-9]+", kv_key("x.y:z *>"))


ME = Holder("hostA", "boot-1", 4026531836, 0, 100, 5000)


def lease(holder: Holder) -> bytes:
    return holder.lease_value("n0nce", Job(data=b"", subject="s", stream_seq=3, delivery=2))


def test_judge_tells_done_free_dead_and_busy():
    starts = {100: 5000, 200: 7000}.get                      # pid -> start time; others are gone
    assert judge(b"done seq=3", None, ME, starts) == ("done", "done seq=3")
    assert judge(b"set by hand", None, ME, starts)[0] == "done"
    assert judge(b"", {"KV-Operation": "DEL"}, ME, starts)[0] == "free"
    assert judge(lease(ME), None, ME, starts) == ("busy", "pid 100 on hostA")          # ourselves, alive
    assert judge(lease(Holder("hostA", "boot-1", ME.pidns, 0, 200, 7000)), None, ME, starts)[0] == "busy"
    assert judge(lease(Holder("hostA", "boot-1", ME.pidns, 0, 300, 1)), None, ME, starts) == ("dead", "pid 300 on hostA")
    assert judge(lease(Holder("hostA", "boot-1", ME.pidns, 0, 200, 6999)), None, ME, starts)[0] == "dead"  # pid reused
    assert judge(lease(Holder("hostB", "boot-2", ME.pidns, 0, 300, 1)), None, ME, starts)[0] == "busy"    # can't tell
    assert judge(lease(Holder("hostA", "boot-1", 999, 0, 300, 1)), None, ME, starts)[0] == "busy"        # other pidns
    assert judge(lease(Holder("hostA", "boot-1", ME.pidns, 1000, 300, 1)), None, ME, starts)[0] == "busy"  # other user
    assert judge(b"lease garbled", None, ME, starts)[0] == "busy"


def test_retry_delays_are_bounded():
    assert retry_after(0.0, 15) == 1.0 and retry_after(5.0, 15) == 5.0 and retry_after(30.0, 15) == 15.0


def test_this_process_reads_its_own_start_time():
    me = this_process()
    assert me.pid == os.getpid() and me.boot and me.start > 0
    assert Holder.parse(lease(me)) == me


# ---------------------------------------------------------------- the guard against a real server

async def _quiet(exc: Exception) -> None:
    """nats-py logs a traceback per failed reconnect otherwise."""


def guard_run(url: str, body, **guard_kwargs):
    async def main():
        nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=_quiet)
        js = nc.jetstream()
        await js.create_key_value(bucket="JOBS_DONE", ttl=3600, history=1)
        g = Guard(nc, "JOBS_DONE", "test", lambda delivery: 2.0 * delivery, **guard_kwargs).start()
        try:
            return await body(g, js)
        finally:
            await g.close()
            with contextlib.suppress(ConnectionResetError):    # nats-py's close() with the server gone
                await nc.close()
    return asyncio.run(main())


def gjob(key: str, delivery: int = 1) -> Job:
    return Job(data=b"", subject="jobs.new", msg_id=key, stream="JOBS", stream_seq=9, delivery=delivery)


def test_guard_claims_marks_done_and_skips_duplicates(nats_server):
    async def body(g, js):
        first = await g.before(gjob("k1"))
        leased = await js.get_msg("KV_JOBS_DONE", subject="$KV.JOBS_DONE.k1")
        again = await g.before(gjob("k1", 2))               # the same key while we run it: busy
        await g.after(gjob("k1"), True)
        done = await g.before(gjob("k1", 3))
        failed = await g.before(gjob("k2"))
        await g.after(gjob("k2"), False)                     # a failure releases the lease at once
        retried = await g.before(gjob("k2", 2))
        entry = await js.get_msg("KV_JOBS_DONE", subject="$KV.JOBS_DONE.k1")
        return first, leased, again, done, failed, retried, entry
    first, leased, again, done, failed, retried, entry = guard_run(nats_server.url, body)
    assert leased.data.startswith(b"lease ") and leased.headers["Nats-TTL"] == str(guard_mod.LEASE_TTL)
    assert first.action == RUN and failed.action == RUN and retried.action == RUN
    assert again.action == RETRY and again.delay == 4.0 and "running it" in again.reason
    assert done.action == DUPLICATE
    assert entry.data.startswith(b"done seq=9 delivery=1") and "Nats-TTL" not in (entry.headers or {})


def test_guard_takes_over_a_dead_holders_lease_and_waits_for_a_live_one(nats_server):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    me = this_process()
    dead_holder = Holder(ME.host, me.boot, me.pidns, me.uid, dead.pid, guard_mod.process_start(dead.pid) or 1)
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_until(lambda: guard_mod.process_start(live.pid), what="the live holder started")
        live_holder = Holder(ME.host, me.boot, me.pidns, me.uid, live.pid, guard_mod.process_start(live.pid))
        other_host = Holder("elsewhere", "another-boot", 1, 0, 1, 1)

        async def body(g, js):
            out = {}
            for name, holder in (("dead", dead_holder), ("live", live_holder), ("other", other_host)):
                await js.publish(f"$KV.JOBS_DONE.{name}", lease(holder), msg_ttl=30)
                out[name] = await g.before(gjob(name))
            return out
        verdicts = guard_run(nats_server.url, body)
    finally:
        live.kill()
        live.wait()
    assert verdicts["dead"].action == RUN
    assert verdicts["live"].action == RETRY and f"pid {live.pid}" in verdicts["live"].reason
    assert verdicts["other"].action == RETRY and "elsewhere" in verdicts["other"].reason


def test_lease_expires_by_its_ttl_when_nobody_renews_it(nats_server):
    """A holder on another machine that died: its lease is gone after the per-message TTL."""
    async def body(g, js):
        await js.publish("$KV.JOBS_DONE.far", lease(Holder("elsewhere", "b", 1, 0, 1, 1)), msg_ttl=1)
        first = await g.before(gjob("far"))
        deadline = asyncio.get_running_loop().time() + 30
        while (v := await g.before(gjob("far", 2))).action != RUN:
            assert asyncio.get_running_loop().time() < deadline, v
            await asyncio.sleep(0.1)
        return first
    assert guard_run(nats_server.url, body).action == RETRY


def test_running_jobs_keep_their_lease_alive(nats_server):
    """Renewed every TTL/3: still ours after several TTLs."""
    async def body(g, js):
        assert (await g.before(gjob("long"))).action == RUN
        first_rev = g.held["long"][0]
        await asyncio.sleep(10)              # the job runs; 3.3 lease lifetimes of 3 s (renewed each 1 s:
        verdict = await g.before(gjob("long", 2))   # a stall of this process under 2 s cannot expire it)
        return first_rev, g.held["long"][0], verdict
    first_rev, later_rev, verdict = guard_run(nats_server.url, body, lease_ttl=3)
    assert later_rev > first_rev and verdict.action == RETRY


def test_guard_never_says_run_when_the_server_is_gone(nats_server, monkeypatch):
    monkeypatch.setattr(guard_mod, "KV_TIMEOUT", 1.0)

    async def body(g, js):
        ok = await g.before(gjob("up"))
        nats_server.stop()
        return ok, await g.before(gjob("down", 2))
    ok, down = guard_run(nats_server.url, body)
    assert ok.action == RUN
    assert down.action == RETRY and down.delay == 4.0 and "unavailable" in down.reason


# ---------------------------------------------------------------- the publish side

def test_publish_same_msg_ids_twice_inside_the_window_stores_five(nats_server, tmp_path):
    first = publish(nats_server.url, count=5, tmp=tmp_path, extra=("--msg-id", "X"))
    second = publish(nats_server.url, count=5, tmp=tmp_path, extra=("--msg-id", "X"))
    assert "5 stored, 0 duplicates" in first
    assert "0 stored, 5 duplicates" in second
    assert nats_server.stream_msgs() == 5


# ---------------------------------------------------------------- the guard in real workers

def idempotent(supervisor_factory, nats_server, *, workers=None, **sections):
    w = {"count": 2, "double_ack": True, **(workers or {})}
    sections.setdefault("idempotency", {"enabled": True})
    return supervisor_factory(nats_server, args=("--log-format", "json"), workers=w, **sections)


def test_republished_after_the_window_is_acked_without_running(nats_server, supervisor_factory, tmp_path):
    sup = idempotent(supervisor_factory, nats_server, stream={"duplicate_window": 1.0})
    sup.wait_ready()
    publish(nats_server.url, count=1, data="0", tmp=tmp_path, extra=("--msg-id", "W"))
    wait_until(lambda: len(sup.jobs.done()) == 1, what="the job done once")
    # Inside the window the stream drops the copy; once it has passed, the copy is stored.
    wait_until(lambda: "1 stored" in publish(nats_server.url, count=1, data="0", tmp=tmp_path, extra=("--msg-id", "W")),
               what="the stream to store the re-published copy", interval=0.2)
    status = wait_until(lambda: (s := sup.status())["jobs"]["duplicate"] == 1 and s, what="the copy acked as a duplicate")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="the copy gone from the stream")
    assert len(sup.jobs.started()) == 1
    assert status["jobs"]["ack"] == 1
    assert sum(w["jobs_duplicate"] for w in status["workers"]["list"]) == 1
    _, metrics = sup.get("/metrics")
    assert 'jetstream_supervisor_jobs_total{outcome="duplicate"} 1.0' in metrics
    assert sup.stop() == 0


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
def test_lease_keeps_a_redelivered_slow_job_from_running_twice(nats_server, supervisor_factory, tmp_path, guard):
    """AckWait 1 s, no in-progress pings, a 4 s job: the server redelivers it to the other worker
    while the first still runs it. With the guard the second sees the lease and NAKs it; the
    first finishes, marks it done and acks. Without the guard it runs twice (the control)."""
    sup = idempotent(supervisor_factory, nats_server, consumer={"ack_wait": 1.0},
                     workers={"progress_pings": False}, idempotency={"enabled": guard})
    sup.wait_ready()
    publish(nats_server.url, count=1, data="4", tmp=tmp_path)
    sup.wait_event("redelivered", seq=1, delivery=2)
    wait_until(lambda: nats_server.stream_msgs() == 0, what="the job acked")
    wait_until(lambda: not sup.jobs.running(), what="every run finished")
    starts = sup.jobs.started()
    if guard:
        assert len(starts) == 1
        assert sup.status()["jobs"]["nak"] >= 1            # the busy NAK
    else:
        assert len(starts) >= 2 and len({r.pid for r in starts}) == 2
    assert sup.stop() == 0


def test_deleted_bucket_never_lets_a_job_run_unguarded(nats_server, supervisor_factory, tmp_path):
    sup = idempotent(supervisor_factory, nats_server, workers={"retry_backoff": [0.5]})
    sup.wait_ready()
    asyncio.run(js_call(nats_server.url, lambda js: js.delete_key_value("JOBS_DONE")))
    publish(nats_server.url, count=3, data="0", tmp=tmp_path)
    wait_until(lambda: sup.status()["jobs"]["nak"] >= 6, what="every job NAKed, again and again")
    assert sup.events("idempotency_unavailable")
    assert sup.jobs.records() == [] and nats_server.stream_msgs() == 3
    # The bucket is back: the jobs run, once each.
    asyncio.run(js_call(nats_server.url, lambda js: js.create_key_value(bucket="JOBS_DONE", ttl=3600, history=1)))
    wait_until(lambda: len(sup.jobs.done()) == 3 and nats_server.stream_msgs() == 0,
               what="the jobs run once the bucket is back")
    assert sorted(r.seq for r in sup.jobs.started()) == [1, 2, 3]
    assert sup.stop() == 0


# ---------------------------------------------------------------- provisioning, warnings, status

def test_start_creates_bucket_warns_and_shows_the_window(nats_server, supervisor_factory, tmp_path):
    sup = idempotent(supervisor_factory, nats_server, workers={"double_ack": False},
                     idempotency={"enabled": True, "ttl": 60.0}, stream={"duplicate_window": 120.0})
    sup.wait_ready()
    assert sup.events("idempotency_ttl_short") and sup.events("idempotency_no_double_ack")
    info = asyncio.run(js_call(nats_server.url, lambda js: js.stream_info("KV_JOBS_DONE")))
    assert info.config.max_age == 60.0 and info.config.allow_msg_ttl and info.config.max_msgs_per_subject == 1
    block = sup.status()["idempotency"]
    assert block == {"enabled": True, "bucket": "JOBS_DONE", "ttl_s": 60.0, "duplicate_window_s": 120.0,
                     "double_ack": False}
    shown = run_cli("config", "show", "--config", str(sup.config_path), tmp=tmp_path)
    assert "duplicate_window = 120.0" in shown.stdout and "[idempotency]" in shown.stdout
    assert sup.stop() == 0


def test_no_warning_when_settings_are_sound(nats_server, supervisor_factory):
    sup = idempotent(supervisor_factory, nats_server)
    sup.wait_ready()
    assert not sup.events("idempotency_ttl_short") and not sup.events("idempotency_no_double_ack")
    assert sup.stop() == 0


def test_missing_bucket_with_stream_create_off_exits_4(nats_server, tmp_path):
    async def setup(js):
        await js.add_stream(api.StreamConfig(name="JOBS", subjects=["jobs.>"], retention=api.RetentionPolicy.WORK_QUEUE))
        await js.add_consumer("JOBS", api.ConsumerConfig(durable_name="workers", ack_policy=api.AckPolicy.EXPLICIT,
                                                         ack_wait=30, max_ack_pending=1000))
    asyncio.run(js_call(nats_server.url, setup))
    r = run_cli("start", "--server", nats_server.url, "--http", "", "--handler", "workers.examples:noop", tmp=tmp_path,
                env={"SUPERVISOR_IDEMPOTENCY_ENABLED": "true", "SUPERVISOR_STREAM_CREATE": "false",
                     "SUPERVISOR_RESTART_DEAD_LETTER_STREAM": ""})
    assert r.returncode == 4, r.stderr
    assert "KV bucket JOBS_DONE does not exist and stream.create is false" in r.stderr and "Traceback" not in r.stderr


def test_bad_bucket_name_exits_2(nats_server, tmp_path):
    r = run_cli("start", "--server", nats_server.url, "--http", "", "--handler", "workers.examples:noop", tmp=tmp_path,
                env={"SUPERVISOR_IDEMPOTENCY_ENABLED": "true", "SUPERVISOR_IDEMPOTENCY_BUCKET": "done.markers"})
    assert r.returncode == 2, r.stderr
    assert "idempotency.bucket" in r.stderr and "Traceback" not in r.stderr


def test_sighup_turns_the_guard_on_and_creates_its_bucket(nats_server, supervisor_factory, tmp_path):
    sup = idempotent(supervisor_factory, nats_server, idempotency={"enabled": False})
    sup.wait_ready()
    before = sup.worker_pids()
    config = tomllib.loads(sup.config_path.read_text())
    config["idempotency"]["enabled"] = True
    sup.config_path.write_text(tomli_w.dumps(config))
    sup.signal(signal.SIGHUP)

    async def bucket_exists(js):
        try:
            return (await js.stream_info("KV_JOBS_DONE")).config.allow_msg_ttl
        except NotFoundError:
            return False
    wait_until(lambda: asyncio.run(js_call(nats_server.url, bucket_exists)), what="the bucket created by the reload")
    wait_until(lambda: not (sup.worker_pids() & before) and sup.wait_ready(), what="every worker replaced")
    publish(nats_server.url, count=1, data="0", tmp=tmp_path, extra=("--msg-id", "R"))
    wait_until(lambda: len(sup.jobs.done()) == 1, what="the job done")

    async def marker(js):
        return (await js.get_msg("KV_JOBS_DONE", subject="$KV.JOBS_DONE.R-1")).data
    assert wait_until(lambda: asyncio.run(js_call(nats_server.url, marker)), what="its done-marker").startswith(b"done ")
    assert sup.stop() == 0
