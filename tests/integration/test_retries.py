"""[retry] in real workers against a real nats-server: a rule that rejects dead-letters after one
run; a rule that retries runs exactly its attempts, each delay drawn from its jittered range and
none shorter than the one before, then dead-letters with the exception in the copy's headers; an
unknown exception name is exit 2 before anything starts."""

from __future__ import annotations

from harness import dead_letter_headers, publish_now, run_cli, wait_until

JSON_LOGS = ("--log-format", "json")


def test_a_rejecting_rule_dead_letters_after_one_run_and_names_the_exception(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, args=JSON_LOGS, workers={"count": 1},
                             retry={"rules": [{"on": ["testhandlers:Declined", "ValueError"], "action": "reject"}]})
    sup.wait_ready(1)
    declined, value = (publish_now(nats_server.url, count=1, data=d)[0] for d in ("raise:Declined", "raise:ValueError"))
    other = publish_now(nats_server.url, count=1, data="fail-once")[0]      # a RuntimeError: no rule, retried
    wait_until(lambda: len(dead_letter_headers(nats_server.url)) == 2 and nats_server.stream_msgs() == 0,
               what="both rejected, the other retried and acked")
    starts = [(r.seq, r.delivery) for r in sup.jobs.started()]
    assert sorted(starts) == sorted([(declined, 1), (value, 1), (other, 1), (other, 2)])
    letters = {int(h["Supervisor-Dead-Letter-Sequence"]): h for h in dead_letter_headers(nats_server.url)}
    assert letters[declined]["Supervisor-Dead-Letter-Error"] == "testhandlers.Declined"
    assert letters[declined]["Supervisor-Dead-Letter-Error-Message"] == f"Declined on delivery 1 of seq {declined}"
    assert letters[value]["Supervisor-Dead-Letter-Error"] == "ValueError"
    assert letters[value]["Supervisor-Dead-Letter-Attempts"] == "1"
    assert letters[value]["Supervisor-Dead-Letter-Reason"].endswith("(retry.rules[0]: reject)")
    assert sup.stop() == 0


def test_a_retrying_rule_runs_its_attempts_with_growing_jittered_delays_then_dead_letters(nats_server,
                                                                                        supervisor_factory):
    """max_attempts = 4, base 0.4, jitter 0.5: the delays after attempts 1-3 are drawn from
    [0.2, 0.4], [0.4, 0.8], [0.8, 1.6] (each logged); the server redelivers no sooner (the
    journal's gaps); the 4th failure is dead-lettered, KeyError in its headers."""
    rule = {"on": ["LookupError"], "max_attempts": 4, "base": 0.4, "jitter": 0.5}
    sup = supervisor_factory(nats_server, args=JSON_LOGS, workers={"count": 2}, retry={"rules": [rule]})
    sup.wait_ready(2)
    [seq] = publish_now(nats_server.url, count=1, data="raise:KeyError")
    wait_until(lambda: dead_letter_headers(nats_server.url), what="the job dead-lettered")
    starts = sorted((r.delivery, r.t) for r in sup.jobs.started() if r.seq == seq)
    assert [d for d, _ in starts] == [1, 2, 3, 4], starts
    failed = sorted((e["delivery"], e["delay"]) for e in sup.events("handler_failed", seq=seq))
    assert [d for d, _ in failed] == [1, 2, 3, 4] and failed[-1][1] is None
    delays = [delay for _, delay in failed[:3]]
    for k, delay in enumerate(delays):
        nominal = 0.4 * 2 ** k
        assert nominal * 0.5 <= delay < nominal, (k, delay)     # jittered: below its nominal value
    assert delays == sorted(delays)
    gaps = [b - a for (_, a), (_, b) in zip(starts, starts[1:])]
    assert all(gap >= delay for gap, delay in zip(gaps, delays)), (gaps, delays)
    [letter] = dead_letter_headers(nats_server.url)
    assert letter["Supervisor-Dead-Letter-Error"] == "KeyError" and letter["Supervisor-Dead-Letter-Attempts"] == "4"
    assert letter["Supervisor-Dead-Letter-Reason"].endswith("(attempt 4 of 4)")
    assert "KeyError on delivery 4" in letter["Supervisor-Dead-Letter-Error-Message"]
    # the dead letter is stored before the original's term: the work queue drops it just after
    wait_until(lambda: nats_server.stream_msgs() == 0, what="the dead-lettered job gone from the work stream")
    assert sup.stop() == 0


def test_an_unknown_exception_name_exits_2_naming_the_rule(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[workers]\nhandler = "workers.examples:noop"\n[monitor]\nhttp = ""\n'
                    '[[retry.rules]]\non = ["ValueError"]\n[[retry.rules]]\non = ["TimeoutError", "NoSuchError"]\n')
    for argv in (["start"], ["config", "check"]):
        result = run_cli(*argv, "--config", str(path), tmp=tmp_path)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert "retry.rules[1].on: no exception named 'NoSuchError' among the builtins" in result.stderr


def test_a_rule_naming_a_module_that_does_not_import_exits_2(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[workers]\nhandler = "workers.examples:noop"\n[monitor]\nhttp = ""\n'
                    '[[retry.rules]]\non = ["no_such_module:Oops"]\n')
    result = run_cli("start", "--config", str(path), tmp=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "retry.rules[0].on: cannot import 'no_such_module': ModuleNotFoundError" in result.stderr
