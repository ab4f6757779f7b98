"""The benchmark harness, run end to end with tiny counts (`python -m bench --smoke`), so it cannot
rot unnoticed. It checks that every scenario runs and yields sane, internally consistent figures;
it asserts nothing about speed (docs/BENCHMARKS.md holds the real numbers)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import psutil
import pytest
from harness import alive, child_env, publish_now, wait_until
from natsauth import first_pick_taken

from bench.handlers import HOLD

REPO = Path(__file__).resolve().parents[2]
# Seen at 169 s on a loaded box once [ordering]'s scenario (about 15 s) was in, and at 210 s at a
# load of 18 with [limits]' scenarios merged beside it (98 s at a load of 4).
SMOKE_TIMEOUT = 300.0


def start_bench(args: list[str], tmp: Path) -> subprocess.Popen:
    """`python -m bench` in a session of its own, its temp files (jsbench-*) under `tmp`."""
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "bench", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=child_env(TMPDIR=str(tmp)))


def stop_bench(proc: subprocess.Popen) -> None:
    """SIGTERM (it stops what it started and removes its workdir), SIGKILL after 30 s; its
    nats-server and contenders get a parent-death signal either way."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, Path]:
    """`python -m bench --smoke`, once per test session: under xdist the first worker to get here
    runs it (under a lock in the session's shared temp root) and the others read its results.
    Each worker ran the whole bench before. (`xdist_group` cannot do it here: pytest-xdist 3.8
    marks a grouped test through a nodeid field pytest 9 no longer reads, so `--dist loadgroup`
    groups nothing.)"""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent                   # popen-gwN's parent: every worker's
    out, failed = shared / "bench-smoke", shared / "bench-smoke.failed"
    with open(shared / "bench-smoke.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)         # the others wait here while one runs it
        if failed.exists():
            raise AssertionError(f"the smoke benchmark failed in another worker: {failed.read_text()}")
        if not (out / "results.json").exists():
            try:
                run_smoke(out)
            except AssertionError as exc:
                failed.write_text(str(exc)[-6000:])
                raise
    return json.loads((out / "results.json").read_text()), out


def run_smoke(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    proc = start_bench(["--smoke", "--out", str(out)], out / "tmp")
    try:
        stdout, stderr = proc.communicate(timeout=SMOKE_TIMEOUT)
    except subprocess.TimeoutExpired:
        stop_bench(proc)
        raise AssertionError(f"the smoke benchmark took more than {SMOKE_TIMEOUT:g}s") from None
    finally:
        if proc.poll() is None:
            stop_bench(proc)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert list((out / "tmp").glob("jsbench-*")) == [], "the bench removes its workdir"


def bench_family(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def cmdlines(family: list[psutil.Process]) -> str:
    out = []
    for p in family:
        with contextlib.suppress(psutil.Error):
            out.append(" ".join(p.cmdline()))
    return " | ".join(out)


def living(family: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in family if alive(p)]


def all_gone(family: list[psutil.Process], timeout: float) -> None:
    try:
        wait_until(lambda: not living(family), timeout=timeout, what="the bench's nats-server and contenders gone")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still running: {cmdlines(living(family))}") from None


def running_bench(tmp_path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """A bench (crash scenario) with its nats-server and a supervisor with a worker running (by
    the worker's process title)."""
    proc = start_bench(["--smoke", "--only", "crash", "--out", str(tmp_path / "out")], tmp_path / "tmp")

    def up():
        assert proc.poll() is None, proc.communicate()
        family = bench_family(proc)
        names = cmdlines(family)
        return family if "nats-server" in names and "supervisor: worker" in names else None
    return proc, wait_until(up, timeout=60, what="the bench's nats-server, supervisor and workers")


def hold_a_job(tmp_path, rundir: str = "crash-ours", timeout: float = 30) -> None:
    """A hold job of our own in one of the bench's crash workers (or loops), started: it never ends
    (the bench kills only the holders of the jobs it published), so a stop finds one busy, the
    worst case (the bench kills its holders within milliseconds, but its death may fall in them)."""
    [config] = wait_until(lambda: list((tmp_path / "tmp").glob("jsbench-*/*-crash-ours/config.toml")),
                          timeout=30, what="the crash scenario's supervisor config")
    [where] = wait_until(lambda: list((tmp_path / "tmp").glob(f"jsbench-*/*-{rundir}")), timeout=timeout,
                         what=f"the bench's {rundir} run")
    [seq] = publish_now(tomllib.loads(config.read_text())["nats"]["servers"][0], count=1, data=HOLD.decode())
    journal = where / "journal.txt"
    wait_until(lambda: journal.exists() and any(line.split()[:2] == [str(seq), "1"]
                                                for line in journal.read_text().splitlines()),
               timeout=timeout, what=f"the hold job seq {seq} started")


def clean_up(proc: subprocess.Popen, family: list[psutil.Process]) -> None:
    """Whatever a failed test left: every process it saw, then the bench."""
    for p in family:
        with contextlib.suppress(psutil.Error):
            p.kill()
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def test_a_sigkilled_bench_takes_its_processes_with_it(tmp_path):
    """The bench's children get SIGTERM at its death (PDEATHSIG): a supervisor then stops
    gracefully, waiting workers.graceful_timeout for a running job. The bench gives its crash
    supervisors CRASH_GRACE_S (their hold jobs never end), so everything is gone well within 20 s;
    at the default 30 s it was not (the CI time-out)."""
    proc, family = running_bench(tmp_path)
    try:
        hold_a_job(tmp_path)
        proc.kill()                          # what a timeout does: the bench alone, no cleanup of its own
        proc.wait()
        all_gone(family, 20)
    finally:
        clean_up(proc, family)


def test_a_sigkilled_bench_takes_its_loops_with_it_while_one_holds_a_job(tmp_path):
    """The crash baseline's seed loops, one running a hold job (a blocking sleep on the loop's
    thread, where its SIGTERM handler cannot run): at the bench's death their launcher passes the
    SIGTERM on, then SIGKILLs what is left after LAUNCH_GRACE_S; everything is gone within 20 s."""
    proc = start_bench(["--smoke", "--only", "crash", "--out", str(tmp_path / "out")], tmp_path / "tmp")
    family: list[psutil.Process] = []
    try:
        hold_a_job(tmp_path, "crash-baseline", timeout=90)
        family = bench_family(proc)
        assert "bench.contenders seed" in cmdlines(family), cmdlines(family)
        proc.kill()
        proc.wait()
        all_gone(family, 20)
    finally:
        clean_up(proc, family)


def test_a_sigtermed_bench_stops_everything_and_removes_its_workdir(tmp_path):
    proc, family = running_bench(tmp_path)
    try:
        assert list((tmp_path / "tmp").glob("jsbench-*")), "the workdir exists while it runs"
        hold_a_job(tmp_path)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        assert rc == 128 + signal.SIGTERM, (rc, proc.communicate())
        all_gone(family, 30)
        assert list((tmp_path / "tmp").glob("jsbench-*")) == []
    finally:
        clean_up(proc, family)


def test_a_bench_nats_server_port_taken_before_it_binds_is_picked_again(tmp_path, monkeypatch):
    """The bench's nats-server ports are picked before it starts; one taken in between (held here,
    for real) makes it exit "address already in use", and it starts again on ports picked again."""
    from bench import natsenv

    with first_pick_taken(monkeypatch, natsenv) as held:
        server = natsenv.NatsServer(tmp_path)
        assert server.port == held
        with server:
            assert server.port != held
            asyncio.run(natsenv.reset_queue(server.url, natsenv.QueueSpec()))      # it is a JetStream server


def positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


@pytest.mark.parametrize("scenario", ["throughput", "tuned"])
def test_throughput_figures_are_sane(smoke, scenario):
    results, _ = smoke
    tp = results[scenario]
    assert {"supervisor", "supervisor-sync", "plain"} <= set(tp["contenders"])
    for run in tp["runs"]:
        assert run["jobs"] == results["profile"]["jobs"] and run["extra"]["section"] == tp["section"]
        assert positive(run["jobs_per_s"]), run
        assert 0 < run["first_ack_s"] <= run["done_s"], run
    for row in tp["summary"]:
        assert positive(row["jobs_per_s"]) and positive(row["vs_plain"]), row
    assert next(r for r in tp["summary"] if r["contender"] == "plain")["vs_plain"] == 1.0


def test_defaults_come_first_and_tuned_last_on_their_own_consumers(smoke):
    results, out = smoke
    text = (out / "tables.md").read_text()
    assert text.index("Throughput, no-op handler, defaults") < text.index("Throughput, no-op handler, tuned")
    assert list(results).index("throughput") < list(results).index("tuned")
    assert results["throughput"]["tuning"] == {} and results["throughput"]["queue"]["max_ack_pending"] == 1000
    assert results["tuned"]["tuning"]["workers"]["batch"] > 256
    assert results["tuned"]["queue"]["max_ack_pending"] == results["tuned"]["tuning"]["consumer"]["max_ack_pending"]
    assert "seed" in results["throughput"]["contenders"] and "seed" not in results["tuned"]["contenders"]


def test_seed_experiment_and_publish_figures_are_sane(smoke):
    results, _ = smoke
    seed = results["seed"]
    for run in seed["runs"]:
        assert sum(run["jobs_per_worker"]) == seed["jobs"] and 1 <= run["workers_used"] <= 3
        assert run["seconds"] >= seed["jobs"] * seed["job_s"] / 3      # it cannot beat the work itself
    pub = results["publish"]
    assert {r["contender"] for r in pub["runs"]} == {"supervisor-publish", "publish-async"}
    for row in pub["summary"]:
        assert positive(row["msgs_per_s"]) and positive(row["vs_async"]) and positive(row["done_s"]), row


def test_cpu_scaling_figures_are_sane(smoke):
    results, _ = smoke
    rows = results["cpu"]["summary"]
    assert {r["contender"] for r in rows} == {"supervisor-sync", "plain", "bare"}
    for row in rows:
        assert positive(row["jobs_per_s"]) and positive(row["efficiency_per_core"]), row
        if row["workers"] == 1:
            assert row["speedup"] == pytest.approx(1.0)


def test_crash_figures_are_sane(smoke):
    results, _ = smoke
    crash = results["crash"]
    kills = results["profile"]["kills"]
    assert len(crash["ours"]) == kills and len(crash["baseline"]) == kills
    for row in crash["ours"]:
        assert row["replacement_pid"] != row["killed_pid"]
        assert row["redelivery"] > row["held_delivery"]
        assert 0 <= row["redelivered_s"] <= row["acked_s"], row
        assert positive(row["replacement_ready_s"]), row
    for row in crash["baseline"]:
        assert 0 <= row["redelivered_s"] <= row["acked_s"], row
    ours, baseline = crash["summary"]
    assert positive(ours["redelivered_p99_s"]) and positive(baseline["redelivered_p99_s"])


def test_footprint_figures_are_sane(smoke):
    results, _ = smoke
    s = results["footprint"]["summary"]
    assert positive(s["worker_uss"]) and s["worker_uss"] <= s["worker_rss"]
    assert positive(s["parent_rss"])
    assert s["parent_cpu_pct"] >= 0 and positive(s["acked_per_s"])
    assert 1 <= s["many_workers_serving"] <= s["many_workers"]
    assert positive(s["many_all_ready_s"]) and positive(s["many_uss_total"])
    assert "plain" in s["baselines"]


def test_guard_cost_figures_are_sane(smoke):
    results, _ = smoke
    guard = results["guard"]
    assert {r["extra"]["variant"] for r in guard["runs"]} == {"no guard", "guard", "double_ack alone",
                                                               "guard + double_ack"}
    for row in guard["summary"]:
        assert positive(row["jobs_per_s"]) and positive(row["vs_no_guard"]), row
    base = next(r for r in guard["summary"] if r["variant"] == "no guard")
    assert base["vs_no_guard"] == 1.0 and base["extra_us_per_job"] == 0


def test_latency_figures_are_sane(smoke):
    results, _ = smoke
    lat = results["latency"]
    assert lat["contenders"] == ["supervisor-sync", "plain"]          # the smoke run's two: ours and the yardstick
    expected = int(lat["rate"] * lat["load_s"])
    for run in lat["runs"]:
        assert run["jobs"] == expected and run["timed"] == expected, run        # every job timed once
        assert 0 < run["p50_s"] <= run["p99_s"] <= run["max_s"], run
    plain = next(r for r in lat["summary"] if r["contender"] == "plain")
    assert plain["p99_vs_plain"] == 1.0
    for row in lat["summary"]:
        assert positive(row["p99_vs_plain"]), row


def test_fairness_figures_are_sane(smoke):
    results, _ = smoke
    fair = results["fairness"]
    assert fair["contenders"] == ["supervisor-sync", "plain"]
    shorts = int(fair["rate"] * fair["load_s"])
    for run in fair["runs"]:
        assert run["timed"] == run["jobs"] == shorts + int(fair["load_s"] / fair["long_every"]), run
        m, w = run["measured"], run["warmup"]
        assert m["jobs"] + w["jobs"] == shorts and m["jobs"] > 0, run
        assert 0 < m["p50_s"] <= m["p99_s"] <= m["max_s"], run
        assert 0 <= m["behind_long"] <= m["jobs"] and 0 <= m["over_limit"] <= m["jobs"], run


def test_tracing_cost_figures_are_sane(smoke):
    """Each traced run counted a span per job at the receiver (else its figure is not tracing's cost)."""
    results, _ = smoke
    rows = {r["variant"]: r for r in results["tracing"]["summary"]}
    assert set(rows) == {"sync, off", "sync, on", "async, off", "async, on"}
    for name, row in rows.items():
        assert positive(row["jobs_per_s"]) and positive(row["vs_off"]), row
        assert row["spans_per_job"] == (1.0 if name.endswith("on") else 0.0), row


def test_ordering_figures_are_sane(smoke):
    results, _ = smoke
    o, p = results["ordering"], results["profile"]
    variants = {(w, k) for w in p["ordering_workers"] for k in (0, *p["ordering_keys"])}
    assert {(r["workers"], r["keys"]) for r in o["summary"]} == variants
    assert all(r["jobs_per_s"] > 0 and r["bound_per_s"] > 0 for r in o["summary"])
    assert all(r["vs_unordered"] > 0 for r in o["summary"] if r["keys"])
    assert [r["variant"] for r in o["noop"]] == ["unordered", "64 keys"] and all(r["jobs_per_s"] > 0 for r in o["noop"])


def test_limit_figures_are_sane(smoke):
    """Each limit variant drained every job; `rate = 10` held (issue 26: every start seen, at most
    10 taken in any second by the server's clock, every job started once) and is among the
    targets."""
    results, _ = smoke
    lim = results["limits"]
    rows = {r["variant"]: r for r in lim["summary"]}
    assert set(rows) == {"no limit", "concurrency 100000", "rate 100000/s"}
    assert all(positive(r["jobs_per_s"]) for r in rows.values()), rows
    held = lim["rate"]
    assert held["starts"] == held["taken"] == held["jobs"] and held["most_taken_in_1s"] <= held["rate"], held
    [target] = [t for t in results["targets"] if t["target"].startswith("rate = 10/s")]
    assert target["met"], target


def test_report_is_written(smoke):
    results, out = smoke
    text = (out / "tables.md").read_text()
    for heading in ("Throughput", "CPU-bound", "seed experiment", "Latency", "Fairness", "Crash recovery", "Footprint",
                    "supervisor publish", "guard's cost", "tuned", "[tracing]'s cost", "Targets"):
        assert heading in text
    assert results["targets"] and all("met" in t for t in results["targets"])
    if importlib.util.find_spec("matplotlib"):
        assert (out / "throughput.png").stat().st_size > 1000
