"""[retry] by itself (workers/middleware/retries.py): backoff growth, cap and jitter with a fixed or
seeded draw, the first matching rule by MRO, reject, attempts across re-published copies, the
old workers.retry_backoff list; and its config ([[retry.rules]]) with the errors that name the key."""

from __future__ import annotations

import json
import random

import pytest

from supervisor.config import Config, ConfigError, load
from workers import Retry
from workers.middleware.retries import (
    ATTEMPTS_HEADER,
    Backoff,
    ByAttempt,
    Policy,
    attempt_of,
    check_names,
    qualified,
    resolve,
)


def policy(text: str, draw=lambda: 0.0, tmp_path=None) -> Policy:
    return Policy.from_config(cfg(text, tmp_path), draw)


def cfg(text: str, tmp_path) -> Config:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return load(path, {}, {})


def test_delays_double_from_base_up_to_max():
    b = Backoff(base=1.0, max=10.0, jitter=0.0)
    assert [b.delay(n, 0.5) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert b.delay(500, 0.0) == 10.0                      # no overflow however many attempts


def test_jitter_draws_each_delay_from_the_lower_part_of_its_range():
    b = Backoff(base=2.0, max=300.0, jitter=0.3)
    assert b.delay(3, 0.0) == 8.0 and b.delay(3, 1.0) == pytest.approx(8.0 * 0.7)
    rng = random.Random(24)
    delays = [b.delay(3, rng.random()) for _ in range(200)]
    assert all(8.0 * 0.7 <= d <= 8.0 for d in delays) and len(set(delays)) == 200    # jittered, never above d
    assert min(delays) < 8.0 * 0.75 and max(delays) > 8.0 * 0.95


def test_the_old_retry_backoff_list_gives_exact_delays_by_attempt():
    b = ByAttempt((1.0, 5.0, 30.0))
    assert [b.delay(n, 0.9) for n in range(1, 6)] == [1.0, 5.0, 30.0, 30.0, 30.0]


def test_the_first_matching_rule_wins_by_mro(tmp_path):
    p = policy('''
[consumer]
max_deliver = 10
[[retry.rules]]
on = ["ValueError", "json:JSONDecodeError"]
action = "reject"
[[retry.rules]]
on = ["OSError"]
max_attempts = 3
base = 0.5
[[retry.rules]]
on = ["ConnectionError"]
action = "reject"
''', tmp_path=tmp_path)
    err = json.JSONDecodeError("bad", "{", 0)              # a ValueError too: the first rule
    assert p.decide(err, 1).delay is None and "retry.rules[0]: reject" in p.decide(err, 1).reason
    conn = ConnectionRefusedError("refused")                 # an OSError: rule 1 comes before rule 2
    assert [p.decide(conn, n).delay for n in (1, 2, 3)] == [0.5, 1.0, None]
    assert p.decide(conn, 3).reason == "ConnectionRefusedError: refused (attempt 3 of 3)"
    other = KeyError("k")                                    # no rule: [retry]'s defaults, max_deliver
    assert [p.decide(other, n).delay for n in (1, 2, 9)] == [1.0, 2.0, 256.0] and p.decide(other, 10).delay is None


def test_a_rules_own_backoff_takes_unset_values_from_retry(tmp_path):
    p = policy('''
[retry]
base = 3.0
max = 7.0
jitter = 0.5
[[retry.rules]]
on = ["TimeoutError"]
jitter = 0.0
''', tmp_path=tmp_path, draw=lambda: 1.0)
    assert [p.decide(TimeoutError(), n).delay for n in (1, 2, 3)] == [3.0, 6.0, 7.0]
    assert p.decide(KeyError(), 1).delay == 1.5             # the defaults keep their jitter


def test_unlimited_max_deliver_and_no_rule_never_dead_letters(tmp_path):
    p = policy("[consumer]\nmax_deliver = -1\n", tmp_path=tmp_path)
    assert p.decide(RuntimeError("x"), 10_000).delay == 300.0


def test_retry_backoff_is_the_default_when_set(tmp_path):
    p = policy("[workers]\nretry_backoff = [0.1, 0.2]\n", tmp_path=tmp_path, draw=lambda: 0.99)
    assert [p.decide(RuntimeError(), n).delay for n in (1, 2, 3)] == [0.1, 0.2, 0.2]
    assert p.delay(1) == 0.1


def test_attempts_count_the_copies_before_this_one():
    assert attempt_of({}, 3) == 3 and attempt_of({ATTEMPTS_HEADER: "7"}, 1) == 8
    assert attempt_of({ATTEMPTS_HEADER: "junk"}, 2) == 2


def test_exception_names_resolve_or_say_why():
    assert resolve("ValueError") is ValueError and resolve("Retry") is Retry
    assert resolve("json:JSONDecodeError") is json.JSONDecodeError
    assert resolve("json.decoder.JSONDecodeError") is json.JSONDecodeError
    for name, words in (("NoSuchError", "no exception named 'NoSuchError' among the builtins"),
                        ("no_such_mod:E", "module 'no_such_mod' is not imported"), ("json:dumps", "not an exception class"),
                        ("json:Nope", "no exception named 'json:Nope'")):
        with pytest.raises(LookupError, match=words):
            resolve(name)
    assert qualified(ValueError()) == "ValueError" and qualified(json.JSONDecodeError("x", "", 0)) == \
        "json.decoder.JSONDecodeError"


def test_rule_config_errors_name_the_key(tmp_path):
    def error(text: str) -> str:
        with pytest.raises(ConfigError) as info:
            cfg(text, tmp_path)
        return str(info.value)
    assert "retry.rules[0].onn: unknown key; did you mean on?" in error('[[retry.rules]]\nonn = ["X"]\n')
    assert "retry.rules[1].action: must be one of retry, reject" in \
        error('[[retry.rules]]\non = ["A"]\n[[retry.rules]]\non = ["B"]\naction = "drop"\n')
    assert "retry.rules[0].on: needs at least one exception name" in error('[[retry.rules]]\naction = "reject"\n')
    assert "retry.rules[0].on: 'not a name' is not an exception name" in error('[[retry.rules]]\non = ["not a name"]\n')
    assert "retry.rules[0].jitter: must be at most 1" in error('[[retry.rules]]\non = ["A"]\njitter = 2.0\n')
    assert "retry.max: must be >= retry.base" in error("[retry]\nbase = 5.0\nmax = 1.0\n")
    assert "workers.retry_backoff: is the old name" in error("[workers]\nretry_backoff = [1.0]\n[retry]\nbase = 2.0\n")
    assert "retry.rules: expected [[retry.rules]] tables" in error('[retry]\nrules = ["ValueError"]\n')


def test_unknown_names_are_found_before_any_fork(tmp_path):
    c = cfg('[[retry.rules]]\non = ["ValueError"]\n[[retry.rules]]\non = ["KeyError", "json:Gone"]\n', tmp_path)
    assert check_names(c.retry.rules) == ("retry.rules[1].on", "no exception named 'json:Gone'")


def test_rules_come_from_the_environment_as_inline_tables(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("")
    c = load(path, {"SUPERVISOR_RETRY_RULES": '[{on = ["ValueError"], action = "reject"}]'}, {})
    assert [(r.on, r.action, r.base) for r in c.retry.rules] == [(("ValueError",), "reject", None)]
    assert c.replace(retry={"jitter": 0.1}).retry.rules == c.retry.rules    # survives a round trip


def test_a_copy_for_later_keeps_the_jobs_own_headers_and_key_and_leaves_the_servers_out():
    """The copy a long delay stores (workers/runtime/later.py): Nats-* headers are the server's
    (a job a schedule fired has Nats-Scheduler, which a client may not publish), the attempts and
    the original key are ours, and every delivery of one message makes the same schedule subject."""
    import datetime as dt

    from supervisor.config import schedules as sched
    from workers import Job
    from workers.runtime.later import copy_of, msg_id

    headers = {"Trace": "t1", "Nats-Msg-Id": "order-7", "Nats-Scheduler": "_sched.JOBS.config.tick",
               "Nats-Schedule-Next": "purge", "Nats-TTL": "60s"}
    job = Job(data=b"x", subject="jobs.new", stream="JOBS", stream_seq=9, delivery=2, headers=headers, msg_id="order-7")
    due = dt.datetime(2026, 12, 2, 1, 0, 0, tzinfo=dt.UTC)
    copy = copy_of(job, 3, "RuntimeError:\n boom", due)
    sent = copy.publish_headers()
    assert sent == {"Trace": "t1", "Supervisor-Attempts": "3", "Supervisor-Key": "order-7",
                    "Supervisor-Retry-Reason": "RuntimeError: boom", sched.PATTERN: "@at 2026-12-02T01:00:00.000Z",
                    sched.TARGET: "jobs.new"}
    assert copy.subject == sched.delayed_subject("JOBS", msg_id(job)) and msg_id(job) == "retry-JOBS-9"
    again = Job(data=b"x", subject="jobs.new", stream="JOBS", stream_seq=9, delivery=3, headers=headers)
    assert copy_of(again, 4, "later", due).subject == copy.subject


def test_a_duplicate_window_shorter_than_a_dead_workers_gap_is_warned(tmp_path, caplog):
    """The window must outlast ack_wait + job_timeout (workers/runtime/later.py's docstring)."""
    from workers.runtime.later import warn_window

    c = cfg("[consumer]\nack_wait = 100.0\n[workers]\njob_timeout = 30.0\n", tmp_path)
    warn_window(c, 130.0)
    assert not [r for r in caplog.records if getattr(r, "event", "") == "republish_window_short"]
    warn_window(c, 120.0)
    [short] = [r for r in caplog.records if getattr(r, "event", "") == "republish_window_short"]
    assert short.gap == 130.0 and short.window == 120.0
