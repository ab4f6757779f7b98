"""F17's first suspect, made harmless: a process of one test that keeps reconnecting to a port
another test's nats-server has since taken over (tests/support/strays.py). Every test names its
stream JOBS and its consumer `workers`, so such a stray would bind to the other test's consumer
and take its jobs outside that test's ledger. Each harness server takes its own credentials
only: the stray is refused, and the server's log names the server the stray was started against."""

from __future__ import annotations

import strays
from harness import NatsServer, publish, wait_until


def test_a_supervisor_of_another_tests_server_cannot_take_jobs_from_the_server_now_on_its_port(
        tmp_path, supervisor_factory, monkeypatch):
    record = tmp_path / "strays.jsonl"
    monkeypatch.setenv(strays.RECORD, str(record))
    old = NatsServer(tmp_path / "old").start()
    stray = supervisor_factory(old, workers={"count": 1})
    stray.wait_ready(1)
    old.stop()                                   # its test is over; its supervisor reconnects forever
    new = NatsServer(tmp_path / "new", port=old.port, monitor_port=old.monitor_port).start()
    assert new.port == old.port, "another process took the old port meanwhile: nothing knocks, the test proves nothing"
    try:
        made = supervisor_factory(new, workers={"count": 1})     # this test's stream and consumer
        made.wait_ready(1)
        assert made.stop() == 0
        publish(new.url, count=3, data="0")
        refused = f'authentication error - User "{old.user}"'
        wait_until(lambda: new.log_path.read_text().count(refused) >= 2 or stray.jobs.records(),
                   what="the stray refused twice, or running this test's jobs")
        assert stray.jobs.records() == []
        consumer = new.consumer()
        assert consumer["delivered"]["stream_seq"] == 0 and consumer["num_pending"] == 3, consumer
    finally:
        new.stop()
    [knocks] = [line for line in strays.summary(record) if line.startswith("refused")]
    assert old.user in knocks and str(new.port) in knocks, knocks
