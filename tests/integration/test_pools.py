"""Pools (issue 28): several queues in one supervisor, each with its own handler, workers and
durable consumer. Real nats-server, real `supervisor start`, real workers; the handlers' own
journal (tests/handlers/testhandlers.py: pid, seq, and a `v2:` tag from `record_v2`) says which
process ran which job, /status which pool each process belongs to.

The speed of one pool beside another's crash loop is measured here only to catch a pool that
stops or crawls (a generous bound, the figures printed); precise speed targets belong in bench."""

from __future__ import annotations

import signal

import psutil
import pytest
import tomli_w
from harness import publish, publish_now, run_cli, wait_until
from test_observability import metric_families
from test_worker_edges import gone

from supervisor.errors import EXIT_HALTED, EXIT_USAGE

EMAIL, REPORTS = "jobs.email.x", "jobs.reports.y"
TWO_POOLS = {"email": {"count": 2, "filter_subject": "jobs.email.>"},
             "reports": {"count": 1, "filter_subject": "jobs.reports.>", "handler": "testhandlers:record_v2"}}


def pools_of(status: dict) -> dict[int, str]:
    """pid -> the pool /status lists the worker under."""
    return {w["pid"]: name for name, p in status["pools"].items() for w in p["workers"]["list"]}


def ready(sup, counts: dict[str, int]) -> dict:
    """Wait until each pool has exactly that many workers, all ready."""
    def check():
        s = sup.try_status()
        ok = s and all(sum(w["state"] == "ready" for w in s["pools"][name]["workers"]["list"]) == n
                       and len(s["pools"][name]["workers"]["list"]) == n for name, n in counts.items())
        return s if ok else None
    return wait_until(check, what=f"workers ready {counts}")


def done(sup, seqs) -> None:
    wait_until(lambda: set(seqs) <= sup.jobs.done_seqs(), what=f"{len(seqs)} jobs done")


def per_pool(sup, *series: tuple[str, dict[str, str]]) -> list[dict[str, float]]:
    """Live /metrics: for each (name, labels), the value of each sample with those labels by its
    `pool` label (a sample without one counts under None)."""
    code, text = sup.get("/metrics")
    assert code == 200, text
    fams = metric_families(text)
    out = []
    for name, labels in series:
        family, found = "jetstream_supervisor_" + name, {}
        for sample in fams[family.removesuffix("_count")].samples:
            if sample.name in (family, family + "_total") and labels.items() <= sample.labels.items():
                found[sample.labels.get("pool")] = sample.value
        out.append(found)
    return out


def test_two_pools_keep_their_jobs_apart_scale_alone_and_reload(nats_server, supervisor_factory, tmp_path):
    sup = supervisor_factory(nats_server, pools=TWO_POOLS)
    status = ready(sup, {"email": 2, "reports": 1})
    assert status["workers"]["target"] == 3 and set(status["pools"]) == {"email", "reports"}
    assert (status["pools"]["email"]["consumer"]["name"], status["pools"]["reports"]["consumer"]["name"]) == \
        ("workers-email", "workers-reports")
    url = nats_server.url
    email = publish_now(url, count=20, data="0.01", subject=EMAIL)
    reports = publish_now(url, count=10, data="0.01", subject=REPORTS)
    done(sup, email + reports)
    owner = pools_of(sup.status())
    ran = {(r.seq, owner.get(r.pid), r.data.startswith("v2:")) for r in sup.jobs.done()}
    assert ran == {*((s, "email", False) for s in email), *((s, "reports", True) for s in reports)}
    # /metrics, per pool: what each pool ran and how many workers it has
    wait_until(lambda: [sup.status()["pools"][p]["jobs"]["ack"] for p in ("email", "reports")] == [20, 10],
               what="every ack counted")
    assert per_pool(sup, ("jobs", {"outcome": "ack"}), ("job_duration_seconds_count", {}), ("workers_target", {}),
                    ("workers", {"state": "ready"})) == [{"email": 20, "reports": 10}] * 2 + [{"email": 2, "reports": 1}] * 2
    # one pool's count changes, the other's does not; without --pool, several pools is an error
    r = run_cli("scale", "3", "--pool", "reports", "--url", sup.http)
    assert r.returncode == 0 and "target 3 workers in pool reports (was 1)" in r.stdout, r.stdout + r.stderr
    ready(sup, {"email": 2, "reports": 3})
    assert per_pool(sup, ("workers_target", {}), ("workers", {"state": "ready"})) == [{"email": 2, "reports": 3}] * 2
    r = run_cli("scale", "1", "--url", sup.http)
    assert r.returncode == EXIT_USAGE and "several pools run here (email, reports)" in r.stderr, r.stderr
    sup.signal(signal.SIGTTIN)                       # one more in every pool
    ready(sup, {"email": 3, "reports": 4})
    # SIGHUP: reports leaves the file and drains; misc arrives; email takes its new count
    pools = {**TWO_POOLS, "email": {**TWO_POOLS["email"], "count": 1}, "misc": {"count": 1,
                                                                                "filter_subject": "jobs.misc.>"}}
    del pools["reports"]
    sup.config_path.write_text(tomli_w.dumps({**sup.config, "pools": pools}))
    sup.signal(signal.SIGHUP)
    status = ready(sup, {"email": 1, "misc": 1})
    wait_until(lambda: "reports" not in sup.status()["pools"] and len(sup.worker_pids()) == 2,
               what="reports' workers gone")
    misc = publish_now(url, count=3, data="0.01", subject="jobs.misc.z")
    done(sup, misc)
    assert sup.stop() == 0


def test_a_crash_loop_a_poison_job_and_a_limit_leave_another_pool_at_full_speed(nats_server, supervisor_factory,
                                                                                tmp_path):
    """Pool `fast` runs 80 jobs of 50 ms alone, then again while pool `crashy` crash-loops (jobs
    that kill their worker, quarantined as poison after 3 deaths each) and pool `limited` holds a
    backlog behind a full [limits.NAME]. Same run, same box: its rate beside them must stay near
    its rate alone."""
    pools = {"fast": {"count": 2, "filter_subject": "jobs.fast.>"},
             "crashy": {"count": 1, "filter_subject": "jobs.crashy.>"},
             "limited": {"count": 2, "filter_subject": "jobs.limited.>"}}
    sup = supervisor_factory(nats_server, pools=pools, restart={"backoff_initial": 0.05, "backoff_max": 0.2},
                             limits={"db": {"concurrency": 1, "subjects": ["jobs.limited.db"]}})
    ready(sup, {"fast": 2, "crashy": 1, "limited": 2})
    url = nats_server.url

    def rate() -> float:
        seqs = publish_now(url, count=80, data="0.05", subject="jobs.fast.x")
        done(sup, seqs)
        recs = [r for r in sup.jobs.records() if r.seq in seqs]
        return len(seqs) / (max(r.t for r in recs if r.event == "done") - min(r.t for r in recs if r.event == "start"))

    alone = rate()
    fast_pids = {pid for pid, pool in pools_of(sup.status()).items() if pool == "fast"}
    gate = tmp_path / "gate"
    publish_now(url, count=3, data=f"until:{gate}", subject="jobs.limited.db")      # one holds the limit, two wait
    publish_now(url, count=40, data="crash", subject="jobs.crashy.x")
    wait_until(lambda: (s := sup.status())["pools"]["crashy"]["crosscheck"]["crashes"] >= 3
               and s["limits"]["db"]["waiting"] >= 1, what="pool crashy crashing, pool limited waiting")
    before = sup.status()["pools"]["crashy"]["crosscheck"]
    beside = rate()
    after = sup.status()
    crashy = after["pools"]["crashy"]["crosscheck"]
    print(f"\npool fast: {alone:.1f} jobs/s alone, {beside:.1f} jobs/s beside pool crashy "
          f"({crashy['crashes'] - before['crashes']} worker deaths, {crashy['quarantined']} quarantined) and pool "
          f"limited ({after['limits']['db']['waiting']} waiting for limit db) = {beside / alone:.2f}x")
    assert crashy["crashes"] - before["crashes"] >= 3, "the crash loop was not running during the measurement"
    assert crashy["quarantined"] >= 1 and after["limits"]["db"]["waiting"] >= 1
    assert after["pools"]["fast"]["crosscheck"]["crashes"] == 0
    assert fast_pids == {pid for pid, pool in pools_of(after).items() if pool == "fast"}, "a fast worker was replaced"
    assert beside >= 0.5 * alone, f"pool fast slowed to {beside / alone:.2f}x beside the other pools' troubles"
    gate.touch()
    assert sup.stop() == 0


def test_a_pool_that_halts_at_boot_stops_alone_and_every_pool_halted_is_exit_5(nats_server, supervisor_factory):
    restart = {"backoff_initial": 0.01, "backoff_max": 0.05, "boot_failures_to_halt": 3}
    pools = {"good": {"count": 1, "filter_subject": "jobs.good.>"},
             "bad": {"count": 1, "filter_subject": "jobs.bad.>", "init": "testhandlers:boom_init"}}
    sup = supervisor_factory(nats_server, pools=pools, restart=restart, args=("--log-format", "json"))
    halted = sup.wait_event("pool_halted", pool="bad")
    assert "3 workers in a row died before becoming ready" in halted["message"]
    status = ready(sup, {"good": 1, "bad": 0})
    assert status["pools"]["bad"]["halted"] and status["pools"]["good"]["halted"] is None
    assert [a["pool"] for a in status["alerts"] if a["kind"] == "halted"] == ["bad"]
    assert sup.get("/healthz") == (503, f"pool bad halted: {status['pools']['bad']['halted']}\n")
    done(sup, publish_now(nats_server.url, count=3, data="0", subject="jobs.good.x"))
    r = run_cli("scale", "2", "--pool", "bad", "--url", sup.http)
    assert r.returncode == EXIT_USAGE and "pool bad halted" in r.stderr
    assert sup.stop() == 0                                  # a clean stop, though a pool had halted
    both = supervisor_factory(nats_server, restart=restart,
                              pools={**pools, "good": {**pools["good"], "init": "testhandlers:boom_init"}})
    assert both.wait() == EXIT_HALTED
    assert "halting: every pool has halted: pool " in both.log()


def test_a_reload_that_leaves_only_a_halted_pool_ends_in_exit_5(nats_server, supervisor_factory):
    """Pool bad halts at boot while good runs; a SIGHUP takes good out of the config. Nothing
    would run then: the reload gives bad another try (as any SIGHUP does a halted pool), and
    when it halts again it is the last pool, so every pool has halted: exit 5, not a
    supervisor left up with nothing running."""
    restart = {"backoff_initial": 0.01, "backoff_max": 0.05, "boot_failures_to_halt": 2}
    pools = {"good": {"count": 1, "filter_subject": "jobs.good.>"},
             "bad": {"count": 1, "filter_subject": "jobs.bad.>", "init": "testhandlers:boom_init"}}
    sup = supervisor_factory(nats_server, pools=pools, restart=restart, args=("--log-format", "json"))
    sup.wait_event("pool_halted", pool="bad")
    sup.config_path.write_text(tomli_w.dumps({**sup.config, "pools": {"bad": pools["bad"]}}))
    sup.signal(signal.SIGHUP)
    assert sup.wait() == EXIT_HALTED
    assert sup.events("pool_removed", pool="good") and sup.events("pool_revived", pool="bad")
    assert "halting: every pool has halted: pool bad" in sup.log()


def test_start_pool_runs_that_pool_alone(nats_server, supervisor_factory):
    """What each instance of systemd/jetstream-supervisor@.service runs: one pool of the shared config."""
    sup = supervisor_factory(nats_server, pools=TWO_POOLS, args=("--pool", "reports"))
    status = ready(sup, {"reports": 1})
    assert list(status["pools"]) == ["reports"] and status["workers"]["target"] == 1
    done(sup, publish_now(nats_server.url, count=2, data="0", subject=REPORTS))
    assert sup.stop() == 0


def test_two_pools_on_the_embedded_server(supervisor_factory):
    """No nats.servers: `start` runs the embedded nats-server for both pools, `supervisor publish`
    stores jobs for each, each pool's jobs run on its own workers, and the stop is clean (exit 0,
    no worker or server left)."""
    sup = supervisor_factory(None, pools=TWO_POOLS)
    status = ready(sup, {"email": 2, "reports": 1})
    assert status["nats"]["embedded"] is True
    url = status["nats"]["servers"][0]
    publish(url, count=6, data="0.01", extra=("--subject", EMAIL))
    publish(url, count=3, data="0.01", extra=("--subject", REPORTS))
    wait_until(lambda: len(sup.jobs.done()) >= 9, what="9 jobs done")
    owner = pools_of(sup.status())
    ran = sorted((r.seq, owner.get(r.pid), r.data.startswith("v2:")) for r in sup.jobs.done())
    assert ran == [*((s, "email", False) for s in range(1, 7)), *((s, "reports", True) for s in range(7, 10))]
    family = psutil.Process(sup.proc.pid).children(recursive=True)
    assert len(family) == 4 and sum("nats-server" in " ".join(p.cmdline()) for p in family) == 1
    assert sup.stop() == 0
    wait_until(lambda: gone(family), timeout=10, what="no worker or nats-server left")


def test_overlapping_pools_and_unknown_pools_are_config_errors(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[workers]\nhandler = "testhandlers:record"\n[pools.all]\n'
                   '[pools.email]\nfilter_subject = "jobs.email.>"\n')
    r = run_cli("start", "--config", str(cfg), tmp=tmp_path)
    assert r.returncode == EXIT_USAGE and "pools all and email overlap" in r.stderr, r.stderr
    cfg.write_text('[workers]\nhandler = "testhandlers:record"\n[pools.email]\nfilter_subject = "jobs.email.>"\n')
    r = run_cli("start", "--config", str(cfg), "--pool", "mail", tmp=tmp_path)
    assert r.returncode == EXIT_USAGE and "--pool: no pool named 'mail'; the config has email" in r.stderr


@pytest.mark.slow
def test_a_budget_shifts_workers_to_the_pool_whose_backlog_they_drain_and_back(nats_server, supervisor_factory):
    """[autoscale] budget = 3 for two pools (min 1, max 2 each): a backlog in a takes a to 2 while
    b keeps 1; b's backlog, come meanwhile, waits (held by the budget) until a's is drained, then
    the workers go to b; then back to a. The pools together never have more than 3. (A worker is
    given where it does the most work: tests/unit/test_autoscale_budget.py.) A count set by hand
    past the budget is kept, and its reason says by how much."""
    pools = {"a": {"count": 1, "filter_subject": "jobs.a.>"}, "b": {"count": 1, "filter_subject": "jobs.b.>"}}
    sup = supervisor_factory(nats_server, pools=pools, args=("--log-format", "json"),
                             autoscale={"enabled": True, "min": 1, "max": 2, "interval": 0.5, "budget": 3})
    ready(sup, {"a": 1, "b": 1})
    target = lambda pool: sup.status()["pools"][pool]["autoscale"]["target"]      # noqa: E731
    url = nats_server.url
    publish_now(url, count=300, data="0.05", subject="jobs.a.x")
    for busy, other in (("a", "b"), ("b", "a"), ("a", "b")):
        wait_until(lambda: target(busy) == 2 and target(other) == 1, timeout=60,
                   what=f"pool {busy} at 2 workers, {other} at 1", interval=0.1)
        publish_now(url, count=600, data="0.05", subject=f"jobs.{other}.x")   # the next backlog, while this one drains
    steps = [(e["pool"], e["from"], e["to"]) for e in sup.events("scaling")]
    # every step up came after the other pool's step down: the two never had 4 together
    assert steps == [("a", 1, 2), ("a", 2, 1), ("b", 1, 2), ("b", 2, 1), ("a", 1, 2)], steps
    status = sup.status()["pools"]["a"]["autoscale"]
    assert (status["budget"], status["cap"]) == (3, 2)
    # The budget binds autoscaling, not a person: a count set by hand past it is kept, and says so.
    r = run_cli("scale", "3", "--pool", "a", "--url", sup.http)
    assert r.returncode == 0, r.stderr
    reason = wait_until(lambda: (s := sup.status()["pools"]["a"])["workers"]["target"] == 3 and s["autoscale"]["reason"],
                        what="a at 3 by hand")
    assert "1 worker(s) over autoscale.budget = 3" in reason, reason
