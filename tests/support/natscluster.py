"""Test support: a real 3-node nats-server cluster on loopback, from the pinned wheel.

    from natscluster import NatsCluster

    with NatsCluster(tmp_path).start() as cluster:     # or the `nats_cluster` fixture
        cluster.urls                                   # every node's client URL
        leader = cluster.stream_leader("JOBS")         # a ClusterNode
        leader.kill(); leader.restart()                # SIGKILL, then the same ports and store
        cluster.stepdown_consumer("JOBS", "workers")   # ask the consumer leader to step down
        cluster.wait_healthy()

    pub = SteadyPublisher(cluster.urls, count=300, rate=20).start()   # load that rides through faults
    pub.join(); set(pub.stored.values())               # the stream seqs of every job stored

Each node is a `harness.NatsServer` (so `jsz()`, `consumer()`, `stream_msgs()` work on it) with a
server name, its own JetStream store dir, its own client, cluster and monitoring ports, and
routes to the other two. Ports are picked once, so a restarted node comes back where it was.

Leaders are read from the nodes' own `/jsz`: a node is a stream or consumer leader when its
entry names it (`cluster.leader == server_name`); only then are its numbers authoritative (a
follower's /jsz can be stale). The answer counts only when every live node agrees on the
leader, so a test never acts on a leader that has just moved. Step-downs go through the
JetStream API (`$JS.API.STREAM.LEADER.STEPDOWN.<stream>`,
`$JS.API.CONSUMER.LEADER.STEPDOWN.<stream>.<consumer>`) with a short-lived nats-py client.
Every wait polls against a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from harness import DEADLINE, NatsServer, wait_until
from natsauth import free_port

CLUSTER_NAME = "jss-test"


class ClusterNode(NatsServer):
    """One clustered nats-server: kill, pause, resume and restart it on the same store."""

    def __init__(self, name: str, root: Path, cluster_port: int, routes: list[str]):
        self.name = name
        self.cluster_port = cluster_port
        self.log_path = root / f"{name}.log"
        self._routes = routes
        # No credentials (harness.NatsServer): nats-py adds the nodes a server advertises to its
        # pool without the userinfo of the configured URLs, and would fail over to them unauthorised.
        super().__init__(root / name, port=free_port(), monitor_port=free_port(), auth=False)

    def start(self) -> ClusterNode:
        # Flags are read at every start, so a restart reuses the ports, routes and store dir.
        self.extra_args = ("--server_name", self.name, "--cluster_name", CLUSTER_NAME,
                           "--cluster", f"nats://127.0.0.1:{self.cluster_port}",
                           "--routes", ",".join(r for r in self._routes if not r.endswith(f":{self.cluster_port}")),
                           "-l", str(self.log_path))
        super().start()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no goodbye to the cluster, the store left as a crash leaves it."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> ClusterNode:
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.alive:
            self.resume()               # a stopped process would never see the SIGTERM
        super().stop()

    def get(self, path: str, timeout: float = 2.0) -> tuple[int, Any]:
        """(HTTP status, JSON body) from the monitoring port; (0, None) when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}{path}", timeout=timeout) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as exc:
            return exc.code, None
        except (OSError, ValueError):
            return 0, None

    def healthy(self) -> bool:
        """/healthz answers 200: the server is up and its JetStream is current with the cluster."""
        return self.alive and self.get("/healthz")[0] == 200

    def claims(self, stream: str, consumer: str | None = None) -> tuple[str | None, dict | None]:
        """(the leader this node's /jsz names, this node's entry) for a stream or a consumer."""
        code, body = self.get("/jsz?consumers=true")
        if code != 200:
            return None, None
        for account in body.get("account_details") or []:
            for s in account.get("stream_detail") or []:
                if s.get("name") != stream:
                    continue
                if consumer is None:
                    return (s.get("cluster") or {}).get("leader"), s
                for c in s.get("consumer_detail") or []:
                    if c.get("name") == consumer:
                        return (c.get("cluster") or {}).get("leader"), c
        return None, None


class NatsCluster:
    """Three (or `size`) clustered nats-servers with JetStream, on free loopback ports."""

    def __init__(self, root: Path, size: int = 3):
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.size = size
        self.nodes = self._nodes()

    def _nodes(self) -> list[ClusterNode]:
        cluster_ports = [free_port() for _ in range(self.size)]
        routes = [f"nats://127.0.0.1:{p}" for p in cluster_ports]
        return [ClusterNode(f"n{i + 1}", self.root, p, routes) for i, p in enumerate(cluster_ports)]

    # -- life cycle

    def start(self) -> NatsCluster:
        """Start every node. A port picked in advance can be taken (by any socket, an outgoing
        connection's included) before its node binds it: then every node's ports, routes among
        them, are picked again. Only here, at the first start: a restart keeps its ports."""
        try:
            for attempt in range(1, 4):
                try:
                    for node in self.nodes:
                        node.start()
                    break
                except AssertionError as exc:
                    self.stop()
                    if attempt == 3 or "address already in use" not in str(exc):
                        raise
                    self.nodes = self._nodes()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- where things are

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def live(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive]

    def node(self, name: str) -> ClusterNode:
        return next(n for n in self.nodes if n.name == name)

    def meta_leader(self) -> str | None:
        """The JetStream meta leader every live node names, or None while they disagree."""
        names = {(n.get("/jsz")[1] or {}).get("meta_cluster", {}).get("leader") for n in self.live()}
        return names.pop() if len(names) == 1 and None not in names else None

    def wait_healthy(self, timeout: float = DEADLINE) -> None:
        """Every live node healthy and one meta leader agreed on (what a test needs before acting)."""
        wait_until(lambda: all(n.healthy() for n in self.live()) and self.meta_leader(), timeout,
                   f"cluster health ({', '.join(n.name for n in self.live())})", interval=0.1)

    def _leader(self, stream: str, consumer: str | None) -> ClusterNode | None:
        names = {n.claims(stream, consumer)[0] for n in self.live()}
        if len(names) != 1 or None in names:
            return None
        name = names.pop()
        node = next((n for n in self.live() if n.name == name), None)
        return node if node is not None and node.claims(stream, consumer)[0] == name else None

    def stream_leader(self, stream: str, timeout: float = DEADLINE, not_on: str | None = None) -> ClusterNode:
        """The live node leading `stream`, once every live node agrees (and it is not `not_on`)."""
        return self._wait_leader(stream, None, timeout, not_on)

    def consumer_leader(self, stream: str, consumer: str, timeout: float = DEADLINE,
                        not_on: str | None = None) -> ClusterNode:
        return self._wait_leader(stream, consumer, timeout, not_on)

    def _wait_leader(self, stream: str, consumer: str | None, timeout: float, not_on: str | None) -> ClusterNode:
        def found() -> ClusterNode | None:
            node = self._leader(stream, consumer)
            return node if node is not None and node.name != not_on else None
        what = f"a leader for {stream}" + (f"/{consumer}" if consumer else "") + (f" other than {not_on}" if not_on else "")
        return wait_until(found, timeout, what, interval=0.1)

    def consumer_state(self, stream: str, consumer: str) -> dict:
        """The consumer's /jsz entry from its leader (a follower's numbers may be stale)."""
        return self.consumer_leader(stream, consumer).claims(stream, consumer)[1]

    def stream_messages(self, stream: str) -> int:
        return self.stream_leader(stream).claims(stream)[1]["state"]["messages"]

    # -- moving leaders

    def stepdown_stream(self, stream: str) -> dict:
        return self.api(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}")

    def stepdown_consumer(self, stream: str, consumer: str) -> dict:
        return self.api(f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}")

    def api(self, subject: str, payload: dict | None = None, timeout: float = 5.0) -> dict:
        """One JetStream API request through any live node; the JSON reply."""
        return asyncio.run(_request([n.url for n in self.live()], subject, payload, timeout))


async def _request(servers: list[str], subject: str, payload: dict | None, timeout: float) -> dict:
    import nats

    async def quiet(exc: Exception) -> None:      # nats-py's default logs a traceback per failed attempt
        pass

    nc = await nats.connect(servers=servers, connect_timeout=2, allow_reconnect=False, error_cb=quiet)
    try:
        reply = await nc.request(subject, json.dumps(payload or {}).encode(), timeout=timeout)
        return json.loads(reply.data)
    finally:
        await nc.close()


class SteadyPublisher:
    """Publishes `count` jobs at `rate` per second from a thread of its own, each retried until
    the stream stores it: with `Nats-Msg-Id: <prefix>-<i>` a retry of a job already stored is a
    duplicate, not a second job. So a fault test knows exactly which jobs exist (`stored`:
    job number -> stream seq) however many PubAcks a leader election swallowed (`retries`)."""

    def __init__(self, servers: list[str], count: int, rate: float, data: str = "0.1",
                 subject: str = "jobs.new", prefix: str = "job"):
        self.servers, self.count, self.rate = servers, count, rate
        self.data, self.subject, self.prefix = data, subject, prefix
        self.stored: dict[int, int] = {}
        self.retries = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="steady-publisher", daemon=True)

    def start(self) -> SteadyPublisher:
        self._thread.start()
        return self

    def join(self, timeout: float = DEADLINE) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"publisher still running after {timeout:g}s ({len(self.stored)} stored)"
        assert self.error is None, f"publisher failed: {self.error!r}"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:       # reported by join()
            self.error = exc

    async def _run(self) -> None:
        import nats
        import nats.errors

        async def quiet(exc: Exception) -> None:
            pass

        nc = await nats.connect(servers=self.servers, error_cb=quiet, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.2)
        js = nc.jetstream()
        started = time.monotonic()
        try:
            for i in range(1, self.count + 1):
                delay = started + (i - 1) / self.rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                while not self._stop.is_set():
                    try:
                        ack = await js.publish(self.subject, self.data.encode(), timeout=2,
                                               headers={"Nats-Msg-Id": f"{self.prefix}-{i}"})
                        self.stored[i] = ack.seq
                        break
                    except (TimeoutError, nats.errors.Error):
                        self.retries += 1          # a leader election: the same id again is safe
                        await asyncio.sleep(0.2)
                if self._stop.is_set():
                    return
        finally:
            await nc.close()
