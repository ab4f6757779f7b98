"""Ensuring the stream and the consumer: create what is missing, never silently rewrite a stream,
update only the consumer settings the server allows, refuse what workers cannot share."""

import asyncio

import nats
from harness import run_cli
from nats.js import api


async def js_call(url, fn):
    nc = await nats.connect(url)
    try:
        return await fn(nc.jetstream())
    finally:
        await nc.close()


def test_existing_stream_is_left_as_it_is_and_differences_logged(nats_server, supervisor_factory):
    asyncio.run(js_call(nats_server.url, lambda js: js.add_stream(
        api.StreamConfig(name="JOBS", subjects=["jobs.>", "other.>"], retention=api.RetentionPolicy.WORK_QUEUE,
                         storage=api.StorageType.MEMORY))))
    sup = supervisor_factory(nats_server, workers={"count": 1}, args=("--log-format", "json"))
    sup.wait_ready(1)
    differs = {(e["stream"], e["setting"]): (e["have"], e["want"]) for e in sup.events("stream_differs")}
    assert differs == {("JOBS", "subjects"): (["jobs.>", "other.>"], ["jobs.>"]), ("JOBS", "storage"): ("memory", "file")}
    info = asyncio.run(js_call(nats_server.url, lambda js: js.stream_info("JOBS")))
    assert info.config.subjects == ["jobs.>", "other.>"] and info.config.storage == api.StorageType.MEMORY
    assert sup.stop() == 0


def test_consumer_settings_are_updated_and_each_change_logged(nats_server, supervisor_factory):
    async def setup(js):
        await js.add_stream(api.StreamConfig(name="JOBS", subjects=["jobs.>"], retention=api.RetentionPolicy.WORK_QUEUE))
        await js.add_consumer("JOBS", api.ConsumerConfig(durable_name="workers", ack_policy=api.AckPolicy.EXPLICIT,
                                                         ack_wait=10, max_ack_pending=50))
    asyncio.run(js_call(nats_server.url, setup))
    sup = supervisor_factory(nats_server, workers={"count": 1}, args=("--log-format", "json"),
                             consumer={"ack_wait": 30.0, "max_ack_pending": 500, "max_deliver": -1})
    sup.wait_ready(1)
    updated = {(e["consumer"], e["setting"]): (e["have"], e["want"]) for e in sup.events("consumer_updated")}
    assert updated == {("workers", "ack_wait"): (10.0, 30.0), ("workers", "max_ack_pending"): (50, 500)}
    info = asyncio.run(js_call(nats_server.url, lambda js: js.consumer_info("JOBS", "workers")))
    assert info.config.ack_wait == 30.0 and info.config.max_ack_pending == 500
    assert sup.stop() == 0


def test_push_consumer_of_the_same_name_is_refused(nats_server, tmp_path):
    async def setup(js):
        await js.add_stream(api.StreamConfig(name="JOBS", subjects=["jobs.>"], retention=api.RetentionPolicy.WORK_QUEUE))
        await js.add_consumer("JOBS", api.ConsumerConfig(durable_name="workers", deliver_subject="push.here",
                                                         ack_policy=api.AckPolicy.EXPLICIT))
    asyncio.run(js_call(nats_server.url, setup))
    r = run_cli("start", "--server", nats_server.url, "--http", "", "--handler", "workers.examples:noop", tmp=tmp_path)
    assert r.returncode == 4
    assert "not a pull consumer" in r.stderr and "Traceback" not in r.stderr


def test_missing_stream_without_create_exits_4(nats_server, tmp_path):
    (tmp_path / "config.toml").write_text("[stream]\ncreate = false\n[monitor]\nhttp = \"\"\n"
                                          "[workers]\nhandler = \"workers.examples:noop\"\n")
    r = run_cli("start", "--server", nats_server.url, tmp=tmp_path)
    assert r.returncode == 4
    assert "stream JOBS does not exist and stream.create is false" in r.stderr
