"""The dashboard (issue 14): `GET /` and `GET /history` on a real supervisor with a worker
SIGKILLed while it held a job, the page rendered by a real headless Chromium (tests/support/browser.py),
and the pure parts (the history ring, the headline) as fast unit tests with a fake clock.

The browser test skips, saying why, only where no chromium is installed; .ci/run installs it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
import uuid
from types import SimpleNamespace

import pytest
from browser import Browser, chromium_binary
from harness import (
    DEADLINE,
    NatsServer,
    SupervisorProc,
    base_config,
    child_env,
    popen_at_a_terminal,
    publish,
    run_cli,
    wait_until,
)
from test_status_cli_demo import marked_processes

from supervisor.observe import history as history_mod
from supervisor.observe.history import History, capacity
from supervisor.observe.status import HEADLINES, headline

JOB_SECONDS = "1.5"       # long enough to SIGKILL a worker while it runs the job
LONG_JOBS = 5             # then these, 300 s each, with consumer.max_ack_pending 3: the numbers hold
MAX_ACK_PENDING = 3       # still and differ (2 pending, 3 in flight, delivered 3 past the ack floor)
SVG_NAMESPACE = "http://www.w3.org/2000/svg"


# ---------------------------------------------------------------- the history ring (pure)

def consumer(pending: int, ack_pending: int = 0, floor: int = 0, delivered: int = 0, redelivered: int = 0) -> dict:
    return {"num_pending": pending, "num_ack_pending": ack_pending, "ack_floor_consumer_seq": floor,
            "delivered_consumer_seq": delivered, "num_redelivered": redelivered}


def test_history_capacity_is_the_window_of_polls_and_never_more_than_the_bound():
    assert capacity(60.0, 1.0) == 62
    assert capacity(60.0, 0.1) == 602
    assert capacity(3600.0, 0.01) == history_mod.MAX_POINTS
    assert capacity(0.5, 1.0) == 3                # shorter than one poll: still a line to draw
    h = History(60.0, 0.01)                       # 6000 polls' worth asked for
    for i in range(10_000):
        h.add(i * 0.001, consumer(i), "ok")       # all inside the window: only the count bounds it
    assert h.capacity == history_mod.MAX_POINTS
    assert len(h.points(10.0)) == history_mod.MAX_POINTS
    assert h.points(10.0)[-1].pending == 9999     # the newest are kept


def test_history_keeps_the_window_by_time_and_marks_failed_polls_as_gaps():
    h = History(10.0, 1.0)
    for t in range(30):
        h.add(float(t), consumer(t, 2, t, t + 2), "growing" if t > 20 else "ok")
    h.gap(30.0, "unknown")
    pts = h.points(30.0)
    assert [p.t for p in pts] == [20.0 + i for i in range(11)]      # 10 s back from the newest
    assert pts[-1].pending is None and pts[-1].ack_floor is None and pts[-1].lag == "unknown"
    assert pts[0].lag == "ok" and pts[1].lag == "growing"
    # Read later: points that aged out of the window are not shown even before the next poll.
    assert [p.t for p in h.points(35.0)] == [25.0 + i for i in range(6)]
    h.add(29.5, consumer(1), "ok")                                  # an answer that lost a race
    assert h.points(30.0)[-1].t == 30.0


def test_history_memory_is_bounded_by_time_when_polls_are_sparse():
    h = History(10.0, 1.0)                        # room for 12 points ...
    for t in range(0, 150, 5):                    # ... but slow polls (a struggling server): 30 in 150 s
        h.add(float(t), consumer(t), "ok")
    assert h.capacity == 12 and len(h) == 3       # only what is inside the window is kept


def test_history_json_has_ages_wall_times_the_seed_numbers_and_crashes_in_the_window():
    h = History(10.0, 1.0)
    h.add(100.0, consumer(38, 2, 0, 2, 0), "ok")
    h.add(101.0, consumer(34, 2, 4, 6, 1), "ok")
    death = SimpleNamespace(t=100.5, slot=1, pid=4321, cause="killed by SIGKILL", held=[SimpleNamespace(seq=9)],
                            crash=True)
    old = SimpleNamespace(t=50.0, slot=0, pid=1111, cause="exit code 13", held=[], crash=True)
    gave_up = SimpleNamespace(t=101.0, slot=2, pid=2222, cause="exit code 0, its last pull request given up", held=[],
                              crash=False)                      # F20: no crash
    out = h.as_dict(now=101.5, wall=1_700_000_001.5, deaths=[old, death, gave_up])
    assert (out["now"], out["interval_s"], out["window_s"], out["capacity"], out["last_seq"]) == \
        (1_700_000_001.5, 1.0, 10.0, 12, 2)
    assert out["samples"] == [
        {"seq": 1, "age_s": 1.5, "t": 1_700_000_000.0, "pending": 38, "ack_pending": 2, "ack_floor": 0,
         "delivered": 2, "redelivered": 0, "lag": "ok"},
        {"seq": 2, "age_s": 0.5, "t": 1_700_000_001.0, "pending": 34, "ack_pending": 2, "ack_floor": 4,
         "delivered": 6, "redelivered": 1, "lag": "ok"}]
    assert out["crashes"] == [{"age_s": 1.0, "t": 1_700_000_000.5, "slot": 1, "pid": 4321,
                               "cause": "killed by SIGKILL", "held": [9]}]
    json.dumps(out)                                                 # plain JSON, no NaN or objects


def test_history_after_a_seq_sends_only_the_newer_samples_and_seqs_survive_trimming():
    h = History(5.0, 1.0)
    for t in range(20):
        h.add(float(t), consumer(t), "ok")
    h.gap(20.0, "unknown")
    assert h.last_seq == 21
    assert [x["seq"] for x in h.as_dict(20.0, 0.0)["samples"]] == [16, 17, 18, 19, 20, 21]
    assert [x["seq"] for x in h.as_dict(20.0, 0.0, after=19)["samples"]] == [20, 21]
    assert h.as_dict(20.0, 0.0, after=21)["samples"] == [] and h.as_dict(20.0, 0.0, after=21)["last_seq"] == 21
    assert [x["seq"] for x in h.as_dict(20.0, 0.0, after=3)["samples"]] == [16, 17, 18, 19, 20, 21]
    h.add(19.0, consumer(0), "ok")                                  # dropped (clock went back): no seq used
    assert h.last_seq == 21


def test_history_resize_keeps_the_newest_points_that_fit():
    h = History(60.0, 1.0)
    for t in range(60):
        h.add(float(t), consumer(t), "ok")
    h.resize(10.0, 0.5)                           # a reload: shorter window, faster polls
    assert h.capacity == 22
    assert [p.t for p in h.points(59.0)] == [49.0 + i for i in range(11)]
    h.resize(5.0, 2.0)
    assert h.capacity == 5 and [p.t for p in h.points(59.0)] == [55.0, 56.0, 57.0, 58.0, 59.0]


# ---------------------------------------------------------------- the headline (pure)

@pytest.mark.parametrize("lag, pending, ack_pending, want", [
    ("ok", 38, 2, "draining"), ("ok", 0, 1, "draining"), ("ok", 0, 0, "idle"), ("growing", 50, 2, "growing"),
    ("stuck", 3, 2, "stuck"), ("unknown", 0, 0, "unknown"), ("no-such-state", 1, 1, "unknown")])
def test_headline_says_the_lag_state_for_the_queue(lag, pending, ack_pending, want):
    h = headline({"state": lag, "reason": "why"}, {"num_pending": pending, "num_ack_pending": ack_pending})
    assert h == {"state": want, "text": HEADLINES[want], "reason": "why"}


def test_headline_without_a_consumer_poll_is_unknown_or_idle_not_an_error():
    assert headline({"state": "unknown"}, {})["state"] == "unknown"
    assert headline({"state": "ok"}, {"num_pending": None})["state"] == "idle"


# ---------------------------------------------------------------- a real supervisor, a real crash

@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """A supervisor with 3 workers; one SIGKILLed while it ran a job; that job redelivered and
    acked; then long jobs that hold the consumer's numbers still, each one different."""
    tmp = tmp_path_factory.mktemp("dashboard")
    server = NatsServer(tmp / "store").start()
    # A 10-minute window: the module's tests may run minutes apart (one at a time, longest files
    # first, over four processes), and the chart must still hold the crash when the browser's turn comes.
    sup = SupervisorProc(tmp, base_config(server, tmp, workers={"count": 3},
                                          consumer={"max_ack_pending": MAX_ACK_PENDING},
                                          monitor={"lag_window": 600.0}))
    try:
        sup.start()
        sup.wait_ready(3)
        publish(server.url, count=3, data=JOB_SECONDS)
        running = wait_until(lambda: [w for w in (sup.try_status() or {"workers": {"list": []}})["workers"]["list"]
                                      if any(j["state"] == "running" for j in w["in_flight"])],
                             what="a worker running a job")
        victim = running[0]["pid"]
        os.kill(victim, signal.SIGKILL)

        def settled():
            s = sup.try_status()
            if not s:
                return None
            deaths = [d for d in s["crosscheck"]["recent_deaths"] if d["pid"] == victim]
            c = s["consumer"]
            return s if (deaths and deaths[0]["held_jobs"]
                         and all(j["acked_after_s"] is not None for j in deaths[0]["held_jobs"])
                         and s["workers"]["ready"] == 3 and s["workers"]["alive"] == 3
                         and c.get("num_pending") == 0 and c.get("num_ack_pending") == 0
                         and c.get("ack_floor_consumer_seq") == c.get("delivered_consumer_seq") > 3) else None
        floor = wait_until(settled, what="the held job redelivered and acked, 3 workers ready, queue empty")[
            "consumer"]["ack_floor_consumer_seq"]
        publish(server.url, count=LONG_JOBS, data="300")

        def holding_still():
            s = sup.try_status()
            c = (s or {}).get("consumer", {})
            want = (LONG_JOBS - MAX_ACK_PENDING, MAX_ACK_PENDING, floor + MAX_ACK_PENDING, floor)
            return s if (c.get("num_pending"), c.get("num_ack_pending"), c.get("delivered_consumer_seq"),
                         c.get("ack_floor_consumer_seq")) == want and s["lag"]["state"] == "ok" else None
        status = wait_until(holding_still, what=f"{MAX_ACK_PENDING} long jobs in flight, the rest waiting")
        yield SimpleNamespace(sup=sup, server=server, victim=victim, status=status, floor=floor, tmp=tmp)
    finally:
        sup.cleanup()
        server.stop()


def fetch(sup: SupervisorProc, path: str) -> tuple[int, dict, bytes]:
    with urllib.request.urlopen(f"http://{sup.http}{path}", timeout=10) as r:
        return r.status, dict(r.headers), r.read()


def external_references(text: str) -> list[str]:
    """Anything in a page that could make a browser reach another place: absolute or
    protocol-relative URLs, src attributes, CSS imports and url(...)."""
    found = [u for u in re.findall(r"(?:[a-z][a-z0-9+.-]*:)?//[^\s\"'<>)]+", text, re.I) if u != SVG_NAMESPACE]
    found += re.findall(r"\bsrc\s*=", text, re.I) + re.findall(r"@import|url\((?!#)", text, re.I)   # url(#id): in-page
    found += [h for h in re.findall(r"\bhref\s*=\s*[\"']([^\"']*)", text, re.I) if h != "data:,"]
    return found


def test_root_serves_one_self_contained_page_and_history_shows_the_crash(crashed):
    code, headers, body = fetch(crashed.sup, "/")
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    page = body.decode()
    assert "<svg" in page and "<script>" in page and "fetch(" in page
    assert external_references(page) == []
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp

    code, headers, body = fetch(crashed.sup, "/history")
    h = json.loads(body)
    assert code == 200 and h["interval_s"] == 0.25 and h["window_s"] == 600.0 and h["pid"] == crashed.sup.proc.pid
    assert h["capacity"] == capacity(600.0, 0.25)
    samples = h["samples"]
    assert len(samples) >= 3 and all(a["age_s"] > b["age_s"] for a, b in zip(samples, samples[1:]))
    last = samples[-1]
    c = crashed.status["consumer"]
    assert (last["pending"], last["ack_pending"], last["ack_floor"], last["delivered"]) == \
        (c["num_pending"], c["num_ack_pending"], c["ack_floor_consumer_seq"], c["delivered_consumer_seq"])
    assert last["lag"] == "ok" and {s["lag"] for s in samples} <= {"ok", "unknown", "growing", "stuck"}
    assert [x["pid"] for x in h["crashes"]] == [crashed.victim]
    assert h["crashes"][0]["cause"].startswith("signal SIGKILL") and h["crashes"][0]["held"]

    newer = wait_until(lambda: json.loads(fetch(crashed.sup, f"/history?after={h['last_seq']}")[2])["samples"],
                       what="a poll after the first /history")
    assert newer[0]["seq"] == h["last_seq"] + 1 and all(x["seq"] > h["last_seq"] for x in newer)
    assert newer[0]["t"] > samples[-1]["t"]
    for bad in ("-1", "x", "1.5", "%C2%B2"):
        code, text = crashed.sup.get(f"/history?after={bad}")
        assert code == 400 and "after=SEQ" in text, (bad, code, text)

    death = next(d for d in crashed.status["crosscheck"]["recent_deaths"] if d["pid"] == crashed.victim)
    assert death["held_jobs"] and all(j["resolved"] == "ack" and 0 < j["came_back_after_s"] <= j["acked_after_s"]
                                      for j in death["held_jobs"])


# ---------------------------------------------------------------- in a real browser

@pytest.fixture(scope="module")
def browser():
    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it when it can): "
                    "the dashboard was not rendered in a browser")
    b = Browser(binary)
    yield b
    b.close()


def texts(page, selector: str) -> list[str]:
    return page.evaluate(f"Array.from(document.querySelectorAll({json.dumps(selector)}), e => e.textContent)")


def test_the_page_renders_workers_lag_numbers_chart_and_the_crash_in_chromium(crashed, browser):
    sup, base = crashed.sup, f"http://{crashed.sup.http}/"
    page = browser.new_page(1000, 1200)
    page.goto(base)
    page.wait_for("Number(document.body.dataset.renders) >= 2", what="two renders from /status and /history")

    # every live worker's pid, from the OS, in the workers table
    live = sup.worker_pids()
    assert len(live) == 3 and crashed.victim not in live
    assert {int(t) for t in texts(page, "#workers td.pid")} == live

    # the seed's numbers as /status has them (the queue is settled: they hold still)
    c = sup.status()["consumer"]
    shown = {k: page.evaluate(f"document.getElementById('n-{k}').textContent")
             for k in ("pending", "ackpending", "redelivered", "delivered", "ackfloor")}
    assert shown == {"pending": f"{c['num_pending']:,}", "ackpending": f"{c['num_ack_pending']:,}",
                     "redelivered": f"{c['num_redelivered']:,}", "delivered": f"{c['delivered_consumer_seq']:,}",
                     "ackfloor": f"{c['ack_floor_consumer_seq']:,}"}
    assert len(set(shown.values()) - {"0"}) == 4          # pending, ackPending, delivered, ackFloor all differ
    assert page.evaluate("document.getElementById('headline').className") == "st-draining"
    assert page.evaluate("document.getElementById('hl-word').textContent") == "Draining"
    assert page.evaluate("document.getElementById('lagline').textContent").startswith("lag ok")
    assert "seq " in " ".join(texts(page, "#workers td")) and "running" in " ".join(texts(page, "#workers td"))

    # the chart: an svg with the pending line through every sample and the crash marked on it
    assert page.evaluate("document.querySelector('#chart').tagName") == "svg"
    points = page.evaluate("(document.getElementById('line-pending').getAttribute('d').match(/[ML]/g) || []).length")
    assert points >= 3
    assert any(str(crashed.victim) in t for t in texts(page, "#chart g.crash text"))
    assert page.evaluate("document.querySelectorAll('#chart rect[fill]').length") >= 2   # the lag strip

    # the SIGKILLed worker in the crash ledger, with what it held and when that came back
    assert str(crashed.victim) in texts(page, "#crashes td.pid")
    ledger = " ".join(texts(page, "#crashes td"))
    assert "signal SIGKILL" in ledger and "back after" in ledger and "acked after" in ledger
    assert texts(page, "#alerts p") == ["none"]
    assert not page.evaluate("document.getElementById('autoscale').hidden")   # /status's autoscale block ...
    assert texts(page, "#autoscale-kv dd")[0] == "no"                          # ... with autoscaling off

    # nothing but this supervisor: every request the page made, and the DOM after its scripts ran
    page.wait_for("Number(document.body.dataset.renders) >= 3", what="a third render")
    page.collect()
    assert page.requests, "no request seen"
    outside = [u for u in page.requests if not (u.startswith(base) or u.startswith("data:"))]
    assert outside == [], outside
    asked = [u[len(base):] for u in page.requests]
    assert {"", "status", "history"} <= set(asked)
    assert any(a.startswith("history?after=") for a in asked)        # a refresh asks only for what is new
    assert external_references(page.evaluate("document.documentElement.outerHTML")) == []
    page.screenshot(crashed.tmp / "dashboard-wide.png")


def test_the_page_fits_a_narrow_window_keeps_its_chart_size_and_has_readable_colours(crashed, browser):
    page = browser.new_page(360, 800)
    page.goto(f"http://{crashed.sup.http}/")
    page.wait_for("Number(document.body.dataset.renders) >= 1", what="a render")
    first = page.evaluate("document.getElementById('chart').getBoundingClientRect().height")
    renders = page.evaluate("Number(document.body.dataset.renders)")
    page.wait_for(f"Number(document.body.dataset.renders) >= {renders + 2}", what="two more renders")
    assert page.evaluate("document.getElementById('chart').getBoundingClientRect().height") == first == 280
    width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1] == 360, f"the page is wider than the window: {width}"
    # below 640 px the tables turn into cards; the pids are still there
    assert page.evaluate("getComputedStyle(document.querySelector('#workers thead')).display") == "none"
    assert {int(t) for t in texts(page, "#workers td.pid")} == crashed.sup.worker_pids()
    page.screenshot(crashed.tmp / "dashboard-narrow.png")

    # WCAG AA: every headline state's text on its background is 4.5:1 or better
    ratios = page.evaluate("""(() => {
        const lum = (c) => { const [r, g, b] = c.match(/\\d+/g).slice(0, 3).map(Number).map((v) => {
            v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
            return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
        const out = {};
        for (const st of ["draining", "idle", "growing", "stuck", "unknown"]) {
            const el = document.createElement("div"); el.className = "st-" + st; document.body.appendChild(el);
            const cs = getComputedStyle(el), a = lum(cs.color), b = lum(cs.backgroundColor);
            out[st] = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05); el.remove();
        }
        return out; })()""")
    assert set(ratios) == {"draining", "idle", "growing", "stuck", "unknown"}
    assert all(r >= 4.5 for r in ratios.values()), ratios


def test_the_page_formatters(crashed, browser):
    """The page's pure formatting, run where it runs: in the browser."""
    page = browser.new_page(800, 600)
    page.goto(f"http://{crashed.sup.http}/")
    page.wait_for("window.dashboard !== undefined", what="the page's script")
    cases = {
        "fmtInt(1234567)": "1,234,567", "fmtInt(null)": "–", "fmtCompact(999)": "999",
        "fmtCompact(1234567)": "1.2M", "fmtCompact(25000)": "25k", "fmtCompact(150000)": "150k",
        "fmtBytes(21000000)": "20.0 MiB", "fmtBytes(512)": "512 B", "fmtBytes(0)": "–",
        "fmtSeconds(0.012)": "12 ms", "fmtSeconds(9.46)": "9.5 s", "fmtSeconds(75)": "1 min 15 s",
        "fmtSeconds(7325)": "2 h 2 min", "fmtSeconds(null)": "–", "fmtRate(3.94)": "+3.9/s", "fmtRate(-2)": "-2.0/s",
        "niceStep(38, 4)": 10, "niceStep(150, 4)": 50, "niceStep(7, 4)": 2, "niceStep(0, 4)": 1,
        "fmtInFlight([{stream_seq: 42, delivery: 2, state: 'running', age_s: 0.1}])": "seq 42 #2 running 100 ms",
        "fmtInFlight([])": "–",
        "fmtHeld({held_jobs: [{stream_seq: 9, state_at_death: 'running', came_back_after_s: 0.012, "
        "acked_after_s: 0.23, resolved: 'ack'}]})": "seq 9 (running): back after 12 ms, acked after 230 ms",
        "fmtHeld({held_jobs: [{stream_seq: 9, state_at_death: 'held', came_back_after_s: null, "
        "acked_after_s: null, resolved: ''}]})": "seq 9 (held): not back yet",
        "fmtHeld({held_jobs: [{stream_seq: 5, state_at_death: 'acked', came_back_after_s: null, "
        "acked_after_s: null, resolved: 'below ack floor'}]})": "seq 5 (acked): below ack floor",
        "fmtHeld({held: [], held_jobs: []})": "nothing",
        "JSON.stringify(lagRuns([{age_s: 3, lag: 'ok'}, {age_s: 2, lag: 'ok'}, {age_s: 1, lag: 'stuck'}], 60))":
            '[{"lag":"ok","from":3,"to":1},{"lag":"stuck","from":1,"to":0}]',
        "linePath([{age_s: 2, v: 1}, {age_s: 1, v: null}, {age_s: 0, v: 3}], (a) => 10 - a, (s) => s.v)":
            "M8.0 1.0M10.0 3.0",
        # the page's copy of the history: merged by seq, aged on the page's clock, trimmed to the window
        "(() => { const st = {pid: null, lastSeq: 0, samples: []};"
        "  const h = (pid, last, seqs, ages) => ({pid, now: 0, window_s: 10, capacity: 50, last_seq: last,"
        "    samples: seqs.map((q, i) => ({seq: q, t: 0, age_s: ages[i]}))});"
        "  mergeHistory(st, h(7, 3, [1, 2, 3], [9, 5, 1]), 100);"
        "  const a = mergeHistory(st, h(7, 5, [3, 4, 5], [4, 2, 0]), 104);"
        "  const b = mergeHistory(st, h(8, 1, [1], [0]), 105);"
        "  return JSON.stringify([a.samples.map((x) => [x.seq, x.age_s]), b.samples.map((x) => x.seq), st.lastSeq]);"
        "})()": "[[[2,9],[3,5],[4,2],[5,0]],[1],1]",
    }
    names = ", ".join(page.evaluate("Object.keys(window.dashboard)"))
    got = {expr: page.evaluate(f"(({{{names}}}) => {expr})(window.dashboard)") for expr in cases}
    assert got == cases

    # The wave-2 blocks (docs/CONTRACT.md: /status "autoscale" and "fleet"): drawn when present, hidden when
    # absent. Drawn and read in one synchronous call, so no refresh comes in between.
    shown = page.evaluate("""(() => { const d = window.dashboard, text = (id) => document.getElementById(id);
        d.drawBlock("autoscale", {enabled: true, target: 5, min: 1, max: 8, reason: "pending rising",
                                  last_change_s: 12.5}, d.autoscalePairs);
        d.drawBlock("fleet", {name: "host-a", peers: 2}, d.fleetPairs);
        const on = [text("autoscale").hidden, text("autoscale-kv").textContent, text("fleet").hidden,
                    text("fleet-kv").textContent];
        d.drawBlock("autoscale", undefined, d.autoscalePairs);
        return on.concat([text("autoscale").hidden]); })()""")
    assert shown == [False, "enabledyestarget5 workers (min 1, max 8)last change12.5 s agoreasonpending rising",
                     False, "this supervisorhost-apeers2", True]


def test_the_page_shows_every_pool_and_the_chosen_pool_below_in_chromium(nats_server, supervisor_factory, browser):
    """With [pools.*]: a Pools table row per pool; the workers, numbers, chart and ordered-per-key
    block below are the first pool's until another is clicked, then that pool's (its /history
    asked with pool=; email is ordered, reports is not)."""
    pools = {"email": {"count": 2, "filter_subject": "jobs.email.>", "ordering_key": "subject:3"},
             "reports": {"count": 1, "filter_subject": "jobs.reports.>", "handler": "testhandlers:record_v2"}}
    sup = supervisor_factory(nats_server, pools=pools)
    sup.wait_ready(3)
    publish(nats_server.url, count=2, data="300", extra=("--subject", "jobs.reports.x"))   # one runs, one waits
    status = wait_until(lambda: (s := sup.try_status()) and s["pools"]["reports"]["consumer"]["num_pending"] == 1
                        and s, what="a reports job running and one waiting")
    pids = {name: {w["pid"] for w in p["workers"]["list"]} for name, p in status["pools"].items()}
    base = f"http://{sup.http}/"
    page = browser.new_page(1000, 1200)
    page.goto(base)
    page.wait_for("Number(document.body.dataset.renders) >= 2", what="two renders")
    assert texts(page, "#pools-table tr[data-pool] button") == ["email", "reports"]
    assert "workers-reports" in texts(page, "#pools-table tr[data-pool=reports] td")[-1]
    assert {int(t) for t in texts(page, "#workers td.pid")} == pids["email"]
    assert not page.evaluate("document.getElementById('ordering').hidden")
    assert "subject:3" in page.evaluate("document.getElementById('ordering-summary').textContent")
    page.evaluate("document.querySelector('#pools-table tr[data-pool=reports] button').click()")
    page.wait_for("document.getElementById('lagline').textContent.includes('JOBS/workers-reports')",
                  what="the reports pool's numbers")
    assert {int(t) for t in texts(page, "#workers td.pid")} == pids["reports"]
    assert page.evaluate("document.getElementById('ordering').hidden")
    assert page.evaluate("document.getElementById('n-pending').textContent") == "1"
    page.wait_for(f"Number(document.body.dataset.renders) >= "
                  f"{page.evaluate('Number(document.body.dataset.renders)') + 2}", what="two more renders")
    page.collect()
    asked = [u[len(base):] for u in page.requests]
    assert "history?pool=reports" in asked and any(a.startswith("history?pool=reports&after=") for a in asked)
    assert page.evaluate("document.querySelector('#pools-table tr[data-pool=reports] button')"
                         ".getAttribute('aria-pressed')") == "true"


# ---------------------------------------------------------------- supervisor demo --dashboard

def test_demo_dashboard_keeps_serving_the_page_after_the_jobs_until_ctrl_c(tmp_path):
    mark = uuid.uuid4().hex
    proc = popen_at_a_terminal([sys.executable, "-m", "supervisor", "demo", "--jobs", "6", "--dashboard"], cwd=tmp_path,
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=child_env(DEMO_TEST_MARK=mark))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        url = wait_until(lambda: next((m.group(1) for m in map(re.compile(r"^  dashboard: (http://\S+/)$").match,
                                                               lines) if m), None), what="the dashboard URL")
        wait_until(lambda: any(f"dashboard stays up at {url} until Ctrl-C" in line for line in lines),
                   what="the demo holding the dashboard open")
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200 and b"<svg" in r.read()
        with urllib.request.urlopen(url + "status", timeout=10) as r:
            x = json.load(r)["crosscheck"]
        assert x["crashes"] == 1 and x["held_jobs_acked_after_crash"] == 1, x
        assert proc.poll() is None                                  # still serving after the story is over
        proc.send_signal(signal.SIGINT)
        assert proc.wait(DEADLINE) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    out = "".join(lines)
    assert out.rstrip().splitlines()[-1].startswith("PASS: every job acked (6/6)"), out
    assert "supervisor stopped cleanly" in out and "Traceback" not in out, out
    wait_until(lambda: not marked_processes(mark), 10, "every process the demo started to be gone")


def test_demo_dashboard_seconds_must_not_be_negative(tmp_path):
    r = run_cli("demo", "--dashboard", "-1", tmp=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "supervisor: error: --dashboard: must be 0 seconds or more, got -1"
    assert "--dashboard [SECONDS]" in run_cli("demo", "--help").stdout
