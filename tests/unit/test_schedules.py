"""Message schedules without a server: the cron grammar as nats-server's cron.go reads it, the
patterns we send, the subjects schedules live under, the [schedules.NAME] checks (each naming its
key) and start's plan (adds, changes and removes its own, leaves `schedule add`'s alone)."""

from __future__ import annotations

import datetime as dt

import pytest

from supervisor.config import ConfigError, load
from supervisor.config import schedules as sched

UTC = dt.UTC


def at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text)


@pytest.mark.parametrize("expr, after, first", [
    ("0 3 * * *", "2026-12-01T04:00:00Z", "2026-12-02T03:00:00Z"),       # 5 fields: minute first, UTC
    ("*/5 * * * *", "2026-12-01T04:01:30Z", "2026-12-01T04:05:00Z"),
    ("30 */10 * * * *", "2026-12-01T04:01:30Z", "2026-12-01T04:10:30Z"),  # 6 fields: seconds first
    ("0 9 * * mon-fri", "2026-12-05T10:00:00Z", "2026-12-07T09:00:00Z"),  # Saturday -> Monday
    ("0 0 13 * 5", "2026-12-01T00:00:00Z", "2026-12-04T00:00:00Z"),       # day 13 OR a Friday (both given)
    ("0 0 * * 0", "2026-12-01T00:00:00Z", "2026-12-06T00:00:00Z"),        # Sunday is 0, as the server
    ("@hourly", "2026-12-01T04:59:59Z", "2026-12-01T05:00:00Z"),
    ("0 0 29 2 *", "2026-12-01T00:00:00Z", "2028-02-29T00:00:00Z"),       # the next leap year
])
def test_cron_fires_when_the_server_would(expr, after, first):
    assert sched.cron_next(sched.parse_cron(expr), at(after)) == at(first)


@pytest.mark.parametrize("expr, problem", [
    ("*/5 * * *", "expected 5 fields"),
    ("61 * * * *", "minutes field '61': '61' is outside 0-59"),
    ("0 24 * * *", "hours field"),
    ("0 0 * * 7", "day of week field '7'"),                  # crontab's 7 = Sunday is not the server's
    ("0 0 * * sun-mon-tue", "too many hyphens"),
    ("0 0 */0 * *", "step 0"),
    ("0 0 5-1 * *", "starts after it ends"),
    ("0 0 30 2 *", "never fires"),                          # the server refuses it too (pattern invalid)
    ("@every 5s", "expected 5 fields"),
    ("0 0 * jan-foo *", "'foo' is not a number or a name"),
])
def test_bad_cron_says_which_field_and_why(expr, problem):
    with pytest.raises(ValueError) as err:
        sched.parse_cron(expr)
    assert problem in str(err.value)


def test_patterns_as_the_server_takes_them():
    assert sched.every_pattern(1) == "@every 1s" and sched.every_pattern(90) == "@every 90s"
    assert sched.every_pattern(1.5) == "@every 1500ms"
    assert sched.cron_pattern("*/5 * * * *") == "0 */5 * * * *"
    assert sched.cron_pattern("30 * * * * *") == "30 * * * * *"
    assert sched.at_pattern(at("2026-12-01T10:00:00.25+01:00")) == "@at 2026-12-01T09:00:00.250Z"
    with pytest.raises(ValueError, match="no UTC offset"):
        sched.parse_at("2026-12-01T10:00:00")


def test_schedule_subjects_keep_out_of_the_job_subjects():
    assert sched.named_subject("JOBS", sched.CONFIG, "tick") == "_sched.JOBS.config.tick"
    assert sched.parse_subject("JOBS", "_sched.JOBS.cli.tick") == ("cli", "tick")
    assert sched.parse_subject("JOBS", "jobs.tick") is None
    # A Nats-Msg-Id names its delayed job's schedule: the same id, the same subject (a re-publish replaces it).
    assert sched.delayed_subject("JOBS", "batch-1") == sched.delayed_subject("JOBS", "batch-1") == "_sched.JOBS.at.batch-1"
    odd = sched.delayed_subject("JOBS", "a.b c")
    assert odd.startswith("_sched.JOBS.at.") and len(odd.split(".")) == 4
    assert sched.delayed_subject("JOBS") != sched.delayed_subject("JOBS")
    assert sched.job_filters("", ["jobs.>", "_sched.JOBS.>"], True) == ("jobs.>",)
    assert sched.job_filters("", ["jobs.>"], False) == ()
    assert sched.job_filters("jobs.a", ["jobs.>", "_sched.JOBS.>"], True) == ("jobs.a",)


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, key, problem", [
    ('cron = "61 * * * *"', "schedules.s.cron", "outside 0-59"),
    ("every = 0", "schedules.s.every", "needs every = SECONDS"),
    ("every = -5", "schedules.s.every", "must be more than 0"),
    ("every = 0.5", "schedules.s.every", "at least 1 second"),
    ('every = 5\ncron = "* * * * *"', "schedules.s.cron", "not both"),
    ('every = 5\nsubject = "other.x"', "schedules.s.subject", "not a job subject of the stream"),
    ('every = 5\nsubject = "jobs.*"', "schedules.s.subject", "plain subject"),
    ('every = 5\nsubject = "_sched.JOBS.x"', "schedules.s.subject", "not a job subject"),
    ('every = 5\nheaders = ["Nats-Msg-Id: x"]', "schedules.s.headers", "a NATS header"),
    ('every = 5\nheaders = ["no colon"]', "schedules.s.headers", "Name: value"),
    ('evry = 5', "schedules.s.evry", "did you mean schedules.s.every?"),
])
def test_bad_schedule_entries_name_the_key(tmp_path, text, key, problem):
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, f"[schedules.s]\n{text}\n"), env={})
    assert err.value.key == key and problem in str(err.value)


def test_schedules_need_the_stream_setting(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, "[stream]\nallow_schedules = false\n[schedules.s]\nevery = 5\n"), env={})
    assert err.value.key == "schedules.s" and "stream.allow_schedules" in str(err.value)
    for subjects in ('["_sched.>"]', '["jobs.>", "*.JOBS.>"]'):
        with pytest.raises(ConfigError) as err:
            load(write(tmp_path, f'[stream]\nsubjects = {subjects}\n'), env={})
        assert err.value.key == "stream.subjects", subjects
    assert load(write(tmp_path, '[stream]\nsubjects = ["*.JOBS.>"]\nallow_schedules = false\n'), env={})


def msg(kind: str, name: str, every: float = 5, data: str = "") -> sched.ScheduleMsg:
    return sched.named("JOBS", kind, name, every=every, cron="", target="jobs.x", data=data, headers=())


def test_plan_makes_its_own_match_and_leaves_the_cli_made_alone():
    stored = {m.subject: (m, seq) for seq, m in enumerate([
        msg("config", "same"), msg("config", "changed", every=10), msg("config", "gone"),
        msg("cli", "byhand"), msg("cli", "twice")], start=1)}
    wanted = [msg("config", "same"), msg("config", "changed"), msg("config", "new"), msg("config", "twice")]
    p = sched.plan("JOBS", wanted, stored)
    assert [m.subject for m in p.add] == ["_sched.JOBS.config.new", "_sched.JOBS.config.twice"]
    assert p.change == ((msg("config", "changed"), 2),)          # with the sequence to compare-and-set on
    assert p.remove == ("_sched.JOBS.config.gone",)              # never _sched.JOBS.cli.byhand
    assert p.keep == ("same",) and p.shadowed == ("twice",)
    assert not sched.plan("JOBS", [msg("config", "same")], {msg("config", "same").subject: (msg("config", "same"), 1)}
                          ).changes_anything


def test_a_stored_schedule_reads_back_equal_to_what_was_sent():
    """What the server adds to a stored schedule (its rollup, our compare-and-set header) is not part
    of it: otherwise every start would rewrite every schedule, restarting its period."""
    m = sched.named("JOBS", "config", "t", every=5, cron="", target="jobs.x", data="d", headers=("B: 2", "A: 1"))
    server_side = {**m.publish_headers(), "Nats-Rollup": "sub", sched.EXPECT_LAST: "0"}
    assert sched.ScheduleMsg.stored(m.subject, server_side, b"d") == m
    assert sched.ScheduleMsg.stored(m.subject, {**server_side, "A": "other"}, b"d") != m


def test_why_a_stream_cannot_hold_schedules_is_said_with_its_fix():
    from types import SimpleNamespace

    from supervisor.config import Config
    from supervisor.nats.schedules import StreamFacts, refusal
    cfg, new, old = Config(), SimpleNamespace(major=2, minor=15), SimpleNamespace(major=2, minor=10)
    ok = StreamFacts(True, ("jobs.>", "_sched.JOBS.>"), 0.0)
    assert refusal(cfg, ok, new) is None
    assert "nats-server 2.10 cannot hold message schedules" in refusal(cfg, StreamFacts(False, ("jobs.>",), 0), old)
    assert "created without message schedules" in refusal(cfg, StreamFacts(False, ("jobs.>",), 0), new)
    assert "does not capture _sched.JOBS.>" in refusal(cfg, StreamFacts(True, ("jobs.>",), 0), new)
    assert "false in the config" in refusal(cfg.replace(stream={"allow_schedules": False}), ok, new)
    # The stream given schedules by hand while the consumer still takes every subject: not yet.
    assert refusal(cfg, StreamFacts(True, ok.subjects, 0.0, ("jobs.>",)), new) is None
    assert "consumer workers delivers _sched.JOBS.> too (its filter: every subject)" in \
        refusal(cfg, StreamFacts(True, ok.subjects, 0.0, ()), new)
    assert "its filter: >" in refusal(cfg, StreamFacts(True, ok.subjects, 0.0, (">",)), new)
