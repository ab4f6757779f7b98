"""The benchmark harness, run end to end with tiny counts (`python -m bench --smoke`), so it cannot
rot unnoticed. It checks that every scenario runs and yields sane, internally consistent figures;
it asserts nothing about speed (docs/BENCHMARKS.md holds the real numbers)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), out


def positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


def test_throughput_figures_are_sane(smoke):
    results, _ = smoke
    tp = results["throughput"]
    assert {"supervisor", "supervisor-sync", "plain", "seed"} <= set(tp["contenders"])
    for run in tp["runs"]:
        assert run["jobs"] == results["profile"]["jobs"]
        assert positive(run["jobs_per_s"]), run
        assert 0 < run["first_ack_s"] <= run["done_s"], run
    for row in tp["summary"]:
        assert positive(row["jobs_per_s"]) and positive(row["vs_plain"]), row
    assert next(r for r in tp["summary"] if r["contender"] == "plain")["vs_plain"] == 1.0


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


def test_report_is_written(smoke):
    results, out = smoke
    text = (out / "tables.md").read_text()
    for heading in ("Throughput", "CPU-bound", "Crash recovery", "Footprint", "guard's cost", "Targets"):
        assert heading in text
    assert results["targets"] and all("met" in t for t in results["targets"])
    if importlib.util.find_spec("matplotlib"):
        assert (out / "throughput.png").stat().st_size > 1000
