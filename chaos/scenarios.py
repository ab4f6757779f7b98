"""The fault matrix: each scenario is its fault schedule and its expectations.

Sizes: `run.pick(quick, full)`. Loads stay well under what 4 workers drain, so jobs never
queue for long and a late redelivery can only be an AckWait expiry (chaos/checker.py).
Sleeps here are fault durations (how long a server stays stopped), never synchronisation:
every wait for something to happen polls it with a deadline.
"""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import tomli_w
from harness import run_cli, wait_until

from . import host
from .core import scenario
from .rig import ChaosNats, Run

PARENT = r"^jetstream-supervisor$"           # the proxy's name pattern for the parent's connection
WORKERS = 4
# Faults outside the supervisor's control: what the server forgot or never delivered comes back
# after AckWait and the ledger cannot explain it; both are reported, not held against it.
OUTSIDE = {"sup_unexplained": None}


def single(run: Run, proxy: bool = False, env: dict | None = None, **sections: dict) -> ChaosNats:
    """One nats-server, the runner connected to it, one supervisor (through the proxy if asked)."""
    server = run.start_server()
    run.connect([server.url])
    url = run.start_proxy(server).url if proxy else server.url
    run.start_supervisor([url], env=env, **sections)
    return server


def flowing(run: Run, jobs: int) -> None:
    """Wait until `jobs` more jobs are done than now."""
    base = run.done_count()
    wait_until(lambda: run.done_count() >= base + jobs, 90, f"{jobs} more jobs done")


def publishing(run: Run) -> bool:
    return any(not f.done() for f in run.publisher.futures)


# ================================================================ workers dying

@scenario("kill")
def kill(run: Run) -> None:
    """Worker SIGKILL at random moments of random jobs under steady load."""
    single(run)
    jobs, kills = run.pick(250, 600), run.pick(5, 12)
    run.load(jobs, rate=60, what="0.05")
    for _ in range(kills):
        time.sleep(run.rng.uniform(0.2, 1.0) * jobs / 60 / kills)   # the schedule: kills spread over the load
        if not publishing(run):
            break
        victim = run.rng.choice(run.wait_running()).pid
        time.sleep(run.rng.uniform(0, 0.05))        # a random moment of the job (the fault schedule)
        run.signal_worker(victim, signal.SIGKILL, "worker SIGKILL")
        run.wait_ready()


@scenario("stop")
def stop(run: Run) -> None:
    """SIGSTOP of a worker running a job: the heartbeat check kills it (heartbeat_timeout 2 s)."""
    single(run, workers={"heartbeat_timeout": 2.0})
    run.load(run.pick(150, 300), rate=30, what="0.1")
    for _ in range(run.pick(2, 4)):
        victim = run.rng.choice(run.wait_running()).pid
        run.signal_worker(victim, signal.SIGSTOP, "worker SIGSTOP, killed by the heartbeat check")
        run.wait_ready()


# ================================================================ routine churn (no fault at all)

@scenario("recycle", expect={"redelivered": 0, "dup": 0})
def recycle(run: Run) -> None:
    """Recycling every 3 jobs (workers.max_jobs = 3) under steady load, nothing else: no job may
    even be redelivered (a NAK spends one of consumer.max_deliver)."""
    single(run, workers={"max_jobs": 3})
    run.load(run.pick(200, 600), rate=50, what="0.02")


@scenario("churn", expect={"dup": 0})
def churn(run: Run) -> None:
    """Recycling every 3 jobs plus SIGTTIN, SIGTTOU, SIGHUP replacing every worker (workers.batch
    changes) and `supervisor scale`, one every 1-2 s under steady load: 0 duplicates."""
    single(run, workers={"max_jobs": 3})
    fut = run.load(run.pick(300, 900), rate=50, what="0.02")
    actions = [ttin, ttou, hup_replace, scale]
    n = 0
    while not fut.done():
        actions[n % len(actions)](run)
        n += 1
        time.sleep(run.rng.uniform(1.0, 2.0))       # the schedule: the next operation


@scenario("scale-recycle", expect={"dup": 0})
def scale_recycle(run: Run) -> None:
    """Scale down to 1 the moment a recycled worker's replacement is forked on a higher slot
    (workers take 0.3 s to get ready, as a slow `init` makes them), while workers recycle every
    3 jobs. Retiring a replacement that is still starting must not stop recycling: workers at
    max_jobs stop pulling, so a stuck recycle stops the pool. Back to 4 and again, until the
    pool stops or the load ends."""
    single(run, workers={"max_jobs": 3, "init": "chaos.handlers:slow_init"})
    fut = run.load(run.pick(120, 400), rate=10, what="0.02")
    for _ in range(run.pick(6, 12)):
        if not replacement_forked(run, fut):
            break
        post_scale(run, 1)
        base = run.done_count()
        time.sleep(2.0)                               # the schedule: one worker for a while
        if run.done_count() == base:
            run.notes.append("the pool stopped after a scale-down caught a replacement starting")
            break                                     # left as it is: the checker counts what stays undone
        post_scale(run, WORKERS)


def replacement_forked(run: Run, fut: Any) -> bool:
    """Wait until a new worker appears on a slot other than 0 (a recycle's replacement)."""
    while not fut.done():
        born = set(run.watcher.lives)
        wait_until(lambda: set(run.watcher.lives) - born or fut.done(), 30, "a worker forked", interval=0.002)
        status = run.sup.try_status() or {"workers": {"list": []}}
        if any(w["pid"] in set(run.watcher.lives) - born and w["slot"] > 0 for w in status["workers"]["list"]):
            return True
    return False


def post_scale(run: Run, n: int) -> None:
    """POST /scale (what `supervisor scale` does) without the CLI's interpreter start-up delay."""
    operation(run, f"POST /scale?workers={n}")
    req = urllib.request.Request(f"http://{run.sup.http}/scale?workers={n}", method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 202, r.status


def operation(run: Run, kind: str) -> None:
    """Routine operations are logged for context; they touch no worker (they must explain nothing)."""
    run.fault(f"op: {kind}", time.monotonic(), pids=set())


def ttin(run: Run) -> None:
    operation(run, "SIGTTIN")
    run.sup.signal(signal.SIGTTIN)


def ttou(run: Run) -> None:
    operation(run, "SIGTTOU")
    run.sup.signal(signal.SIGTTOU)


def hup_replace(run: Run) -> None:
    """SIGHUP after changing workers.batch (a REPLACE key): every worker is replaced."""
    sup = run.sup
    sup.config["workers"]["batch"] = 8 if sup.config["workers"].get("batch", 16) == 16 else 16
    sup.config_path.write_text(tomli_w.dumps(sup.config))
    operation(run, f"SIGHUP (workers.batch={sup.config['workers']['batch']})")
    sup.signal(signal.SIGHUP)


def scale(run: Run) -> None:
    n = run.rng.randint(2, 6)
    operation(run, f"supervisor scale {n}")
    r = run_cli("scale", str(n), "--url", f"http://{run.sup.http}")
    assert r.returncode == 0, r.stderr


# ================================================================ the server

@scenario("server-kill", expect={**OUTSIDE, "healthz_s": 10.0})
def server_kill(run: Run) -> None:
    """nats-server SIGKILLed under load and restarted 1 s later on the same store and ports."""
    server = single(run)
    run.load(run.pick(400, 900), rate=60, what="0.05")
    for _ in range(run.pick(1, 2)):
        outage(run, "nats-server SIGKILL + restart", server.kill, server.start, 1.0)


@scenario("server-stop", expect={**OUTSIDE, "healthz_s": 10.0})
def server_stop(run: Run) -> None:
    """nats-server SIGSTOPped for 4 s under load, then SIGCONT."""
    server = single(run)
    run.load(run.pick(400, 900), rate=60, what="0.05")
    outage(run, "nats-server SIGSTOP 4s", server.pause, server.resume, 4.0)


def outage(run: Run, kind: str, take: Callable[[], Any], restore: Callable[[], Any], seconds: float) -> None:
    """Once jobs flow, take the server away for `seconds`; then time /healthz coming back."""
    flowing(run, 60)
    t0 = time.monotonic()
    take()
    time.sleep(seconds / 2)                           # the outage, with a look at /healthz half way
    try:
        code, text = run.sup.get("/healthz")
    except OSError as exc:
        code, text = 0, f"no answer ({exc})"
    run.notes.append(f"/healthz during '{kind}': {code} {text.strip()}")
    time.sleep(seconds / 2)
    restore()
    f = run.fault(kind, t0, time.monotonic(), in_control=False)
    run.measure_healthz(f.t1)


# ================================================================ out of memory

def oom_faults(run: Run, keys: set[str], kind: str) -> None:
    """After the fact, from the journal: each `oom` job's first run, from its start until its
    worker was reaped (or the end of the run: a worker that survived is out of memory for good).
    It touched its own worker and any other the kernel killed meanwhile (an OOM killer picks by
    size, not by guilt)."""
    wait_until(lambda: {r.key for r in run.tail.poll() if r.event == "D"} >= keys, 60 + run.ack_wait,
               "every oom job done at a later delivery")
    for r in run.tail.recs:
        if r.event == "S" and r.key in keys and r.delivery == 1:
            life = run.watcher.lives.get(r.pid)
            died = life.died if life and life.died else float("inf")
            victims = {lf.pid for lf in run.watcher.lives.values() if lf.died is not None and r.t <= lf.died <= died}
            run.fault(kind, r.t, died, pids={r.pid} | victims)


def oom_load(run: Run) -> set[str]:
    n = run.pick(150, 400)
    oom = set(range(25, n, 60))
    run.load(n, rate=40, what=lambda i: "oom:0.05" if i in oom else "0.05")
    return {f"j{i}" for i in oom}


@scenario("oom-kill", skip=lambda: host.why_not_cgroup("memory"))
def oom_kill(run: Run) -> None:
    """A worker's handler allocates until the kernel OOM-kills it (memory cgroup limit 400 MB
    shared by the workers): SIGKILL from the kernel, not from us."""
    cg = host.make_cgroup("memory", run.name)
    run.undo.append(lambda: host.remove_cgroup(cg))
    (cg / "memory.limit_in_bytes").write_text(str(400 << 20))
    single(run, env={"CHAOS_MEMCG": str(cg)}, workers={"init": "chaos.handlers:join_memory_cgroup"})
    oom_faults(run, oom_load(run), "worker OOM-killed (memory cgroup)")


@scenario("oom-rlimit")
def oom_rlimit(run: Run) -> None:
    """A worker's handler allocates until RLIMIT_AS refuses (MemoryError, wherever it strikes:
    in the handler, in the worker's loop, in its NATS client) and keeps what it took."""
    single(run, env={"CHAOS_AS_HEADROOM_MB": "200"}, workers={"init": "chaos.handlers:limit_address_space"})
    oom_faults(run, oom_load(run), "worker out of address space (RLIMIT_AS)")


# ================================================================ graceful_timeout running out

def long_jobs(run: Run, n: int, every: int, rate: float) -> set[str]:
    """`n` jobs, every `every`-th of them 3 s long on its first delivery and 1 s on later ones
    (long enough for a stray NAK to catch a redelivery running)."""
    long = set(range(every // 2, n, every))
    run.load(n, rate=rate, what=lambda i: "3:1" if i in long else "0.05")
    return {f"j{i}" for i in long}


def cut_short(run: Run, keys: set[str], kind: str) -> None:
    """After the fact: each run of a long job that never finished was cut short by
    graceful_timeout; the fault lasts until its worker was reaped."""
    wait_until(lambda: {r.key for r in run.tail.poll() if r.event == "D"} >= keys, 60 + run.ack_wait,
               "every long job done")
    finished = {(r.pid, r.seq, r.delivery) for r in run.tail.recs if r.event == "D"}
    for r in run.tail.recs:
        if r.event == "S" and r.key in keys and (r.pid, r.seq, r.delivery) not in finished:
            life = run.watcher.lives.get(r.pid)
            run.fault(kind, r.t, life.died if life and life.died else float("inf"), pids={r.pid})


@scenario("graceful-recycle")
def graceful_recycle(run: Run) -> None:
    """graceful_timeout (1 s) runs out on 3 s jobs while their workers are recycled (max_jobs 2).
    Long jobs overlap, so an older delivery holds the consumer's ack floor down: only then does
    the server act on a stale NAK (nats-server ignores NAKs at or below the ack floor)."""
    single(run, workers={"max_jobs": 2, "graceful_timeout": 1.0})
    keys = long_jobs(run, run.pick(60, 200), every=4, rate=6)
    cut_short(run, keys, "graceful_timeout (1 s) ran out on a long job during a recycle")


@scenario("graceful-term")
def graceful_term(run: Run) -> None:
    """SIGTERM while 3 s jobs run, graceful_timeout 1 s: the supervisor exits 0, a new one
    takes over, and nothing the first left behind waits for AckWait."""
    server = single(run, workers={"count": 2, "graceful_timeout": 1.0})
    keys = long_jobs(run, run.pick(60, 150), every=7, rate=6)
    for _ in range(run.pick(1, 3)):
        wait_until(lambda: [r for r in run.running() if r.key in keys and r.delivery == 1], 60, "a long job running")
        t0 = time.monotonic()
        run.stop_supervisor(run.sup)
        run.fault("op: supervisor SIGTERM, then a new one", t0, time.monotonic(), pids=set())
        run.start_supervisor([server.url], workers={"count": 2, "graceful_timeout": 1.0})
    cut_short(run, keys, "graceful_timeout (1 s) ran out on a long job at SIGTERM")


@scenario("term-restart", expect={"dup": 0, "bounced": 0})
def term_restart(run: Run) -> None:
    """The supervisor SIGTERMed and started again while 800 jobs/s pour in: 2 workers with
    256-message pulls outstanding (near-instant jobs make the prefetch the whole batch). Each
    drain must NAK what it pulled and did not start, and lose nothing in flight to it (the
    drain fence)."""
    workers = {"count": 2, "batch": 256}
    server = single(run, workers=workers)
    restarts = run.pick(3, 6)
    run.load(int(800 * (1.5 * restarts + 2)), rate=800, what="0", window=64)
    for _ in range(restarts):
        flowing(run, 400)
        t0 = time.monotonic()
        run.stop_supervisor(run.sup)
        run.fault("op: supervisor SIGTERM, then a new one", t0, time.monotonic(), pids=set())
        run.start_supervisor([server.url], workers=workers)


# ================================================================ the network (chaos/proxy.py)

def connected(run: Run, state: bool) -> bool:
    s = run.sup.try_status()
    return bool(s) and s["nats"]["connected"] == state


@scenario("net-cut-parent")
def net_cut_parent(run: Run) -> None:
    """The parent's connection cut for a few seconds (workers keep theirs), and a worker
    SIGKILLed meanwhile: its jobs must be NAKed once the parent is back, not left to AckWait."""
    single(run, proxy=True)
    run.load(run.pick(80, 160), rate=6, what="0.5")
    flowing(run, 5)
    t0 = time.monotonic()
    assert run.bg.call(run.proxy.cut(PARENT)) == 1, "the parent's connection is not through the proxy"
    wait_until(lambda: connected(run, False), 30, "the parent to notice the cut")
    for _ in range(run.pick(1, 2)):
        victim = run.rng.choice(run.wait_running()).pid
        run.signal_worker(victim, signal.SIGKILL, "worker SIGKILL while the parent is cut off")
    time.sleep(2.0)                                   # the partition lasts a little longer
    run.bg.call(run.proxy.heal(PARENT))
    run.fault("network: the parent's connection cut", t0, time.monotonic(), pids=set())
    wait_until(lambda: connected(run, True), 30, "the parent reconnected")


@scenario("net-stall-parent")
def net_stall_parent(run: Run) -> None:
    """The parent's connection stalls (half-open, 12 s; the proxy stalls its reconnections too: a
    partition of the parent alone) and a worker is SIGKILLed meanwhile. Nothing the parent sends
    reaches the server until the partition heals, so the NAK (held back once the parent's 5 s
    pings notice the dead link, or buffered in the stalled socket before that) lands then: the
    job comes back after the partition, well before AckWait (30 s), and nothing else goes wrong."""
    single(run, proxy=True)
    run.load(run.pick(150, 250), rate=6, what="0.5")
    flowing(run, 5)
    t0 = time.monotonic()
    assert run.bg.call(run.proxy.stall(PARENT)) == 1
    victim = run.rng.choice(run.wait_running()).pid
    run.signal_worker(victim, signal.SIGKILL, "worker SIGKILL while the parent's connection is stalled")
    time.sleep(12.0)                                  # the stall
    run.bg.call(run.proxy.heal(PARENT))
    run.fault("network: the parent's connection stalled 12 s", t0, time.monotonic(), pids=set())


@scenario("net-stall-worker", expect=OUTSIDE)
def net_stall_worker(run: Run) -> None:
    """One worker's connection stalls (half-open) for longer than AckWait while its heartbeat in
    shared memory stays fresh. What was on the wire to it comes back after AckWait (the README
    says so: a worker that stops hearing from NATS gets no +WPI), so the stall counts as outside
    the supervisor's control; its acks must not turn into duplicates nobody explains."""
    single(run, proxy=True, workers={"count": 2})
    run.load(int(5 * (run.ack_wait + 25)), rate=5, what="0.2")
    flowing(run, 5)
    pid = next(w["pid"] for w in run.sup.status()["workers"]["list"] if w["slot"] == 0)
    t0 = time.monotonic()
    assert run.bg.call(run.proxy.stall(r" worker 0$")) == 1
    time.sleep(run.ack_wait + 8)                      # the half-open connection outlives AckWait
    run.bg.call(run.proxy.heal(r" worker 0$"))
    # The worker gave up on the stalled connection long ago; what it carried (pull requests)
    # reaches the server now, which may hand that dead connection jobs until it is closed.
    wait_until(lambda: run.bg.call(run.proxy.count(r" worker 0$")) <= 1, 10, "the stale connections closed")
    run.fault(f"network: worker 0's connection stalled {run.ack_wait + 8:g}s", t0, time.monotonic(), pids={pid},
              in_control=False)


@scenario("net-reset", expect=OUTSIDE)
def net_reset(run: Run) -> None:
    """Every connection (parent and workers) reset with an RST under load, a few times."""
    single(run, proxy=True)
    run.load(run.pick(300, 700), rate=50, what="0.05")
    for _ in range(run.pick(2, 4)):
        flowing(run, 50)
        t0 = time.monotonic()
        run.bg.call(run.proxy.reset(".*"))
        wait_until(lambda: len(run.proxy.matching(".*")) >= WORKERS + 1, 30, "every connection back")
        run.fault("network: every connection reset (RST)", t0, time.monotonic(), in_control=False)


# ================================================================ the host

@scenario("fork-fail", skip=lambda: host.why_not_cgroup("pids"))
def fork_fail(run: Run) -> None:
    """fork() fails with EAGAIN for 3 s (a full pids cgroup, as under systemd TasksMax) just as a
    SIGKILLed worker has to be replaced: the supervisor must survive and restart it later."""
    single(run)
    run.load(run.pick(200, 400), rate=40, what="0.05")
    flowing(run, 20)
    cg = host.make_cgroup("pids", run.name)
    run.undo.append(lambda: host.remove_cgroup(cg))
    host.join_cgroup(cg, [run.sup.proc.pid, *run.sup.worker_pids()])
    t0 = time.monotonic()
    (cg / "pids.max").write_text("1")                 # no new process or thread in the group
    victim = run.rng.choice(run.wait_running()).pid
    run.signal_worker(victim, signal.SIGKILL, "worker SIGKILL while fork() fails")
    time.sleep(3.0)                                   # fork keeps failing this long
    (cg / "pids.max").write_text("max")
    run.fault("fork() fails with EAGAIN (pids cgroup full, like TasksMax)", t0, time.monotonic(), pids=set())
    if run.sup.proc.poll() is None:                   # a supervisor that died is the checker's verdict
        run.wait_ready(timeout=60)


@scenario("disk-full", expect={**OUTSIDE, "vanished": None, "unacked": None, "healthz_s": 10.0},
          skip=host.why_not_tmpfs)
def disk_full(run: Run) -> None:
    """The file store's disk (a 64 MB tmpfs) fills up for 4 s under load. nats-server marks the
    stream failed on a write error until it restarts, so an operator's restart follows."""
    mnt = run.dir / "disk"
    host.mount_tmpfs(mnt, 64)
    run.undo.append(lambda: host.unmount(mnt))
    server = run.start_server(mnt / "store")
    run.connect([server.url])
    run.start_supervisor([server.url])
    run.load(run.pick(300, 600), rate=40, what="0.05")
    flowing(run, 40)
    t0 = time.monotonic()
    filler = host.fill(mnt)
    time.sleep(4.0)                                   # the disk stays full
    filler.unlink()
    server.stop()                                     # the operator's remedy
    server.start()
    f = run.fault("disk full under the file store 4 s, then a server restart", t0, time.monotonic(),
                  in_control=False)
    run.measure_healthz(f.t1)


# ================================================================ a cluster

@scenario("cluster-leaders", expect=OUTSIDE)
def cluster_leaders(run: Run) -> None:
    """A 3-node cluster, R3 stream: the stream leader SIGKILLed mid-load (restarted 2 s later on
    its store), then the consumer leader."""
    cluster = run.start_cluster()
    run.connect(cluster.urls)
    run.start_supervisor(cluster.urls, stream={"replicas": 3})
    run.load(run.pick(400, 900), rate=50, what="0.05")
    for role in ("stream", "consumer"):
        flowing(run, 60)
        node = cluster.stream_leader("JOBS") if role == "stream" else cluster.consumer_leader("JOBS", "workers")
        t0 = time.monotonic()
        node.kill()
        time.sleep(2.0)                               # the node stays down
        node.start()
        cluster.wait_healthy()
        run.fault(f"cluster: {role} leader {node.name} SIGKILLed, back 2 s later", t0, time.monotonic(),
                  in_control=False)
