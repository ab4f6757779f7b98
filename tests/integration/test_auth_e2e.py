"""Every NATS auth mode end to end: `supervisor start` against a real nats-server configured for
it processes jobs; a wrong secret exits 4 with a clear reason; no secret appears anywhere."""

import pytest
from harness import run_cli, wait_until
from natsauth import MODES, nats_auth_server


def leaked(texts, secrets) -> list[str]:
    return [s for s in secrets for t in texts if s and s in t]


@pytest.mark.parametrize("mode", MODES)
def test_supervisor_works_with_auth_mode(mode, tmp_path, supervisor_factory):
    with nats_auth_server(mode, tmp_path) as case:
        sup = supervisor_factory(None, nats={**{k: v for k, v in case.section().items() if v}, "startup_timeout": 10.0},
                                 workers={"count": 2})
        sup.wait_ready(2)
        pub = run_cli("publish", "--config", str(sup.config_path), "--count", "5", "--data", "0", tmp=sup.tmp)
        assert pub.returncode == 0, pub.stderr
        wait_until(lambda: len(sup.jobs.done()) == 5, what="5 jobs done")
        shown = run_cli("config", "show", "--config", str(sup.config_path), tmp=sup.tmp)
        lag = run_cli("lag", "--config", str(sup.config_path), tmp=sup.tmp)
        assert "pending=0" in lag.stdout, lag.stderr
        outputs = [sup.log(), pub.stdout + pub.stderr, shown.stdout + shown.stderr, lag.stdout + lag.stderr,
                   sup.get("/status")[1], sup.get("/metrics")[1]]
        assert sup.stop() == 0
        assert leaked(outputs + [sup.log()], case.all_secrets) == []


@pytest.mark.parametrize("mode", MODES)
def test_wrong_secret_exits_4_without_leaking(mode, tmp_path, supervisor_factory):
    with nats_auth_server(mode, tmp_path) as case:
        sup = supervisor_factory(None, start=False,
                                 nats={**{k: v for k, v in case.section(wrong=True).items() if v}, "startup_timeout": 5.0})
        sup.start()
        code = sup.wait(30)
        log = sup.log()
        assert code == 4, log
        line = [ln for ln in log.splitlines() if ln.startswith("supervisor: error:")]
        assert len(line) == 1 and f"127.0.0.1:{case.port}" in line[0], log
        assert "Traceback" not in log
        assert leaked([log], case.all_secrets) == []
