"""Secrets never shown, /scale only from loopback."""

import socket
import urllib.request

import psutil
import pytest
from harness import NatsServer, publish, run_cli, wait_until

PASSWORD = "s3cr3t-in-the-url-7f2a"


@pytest.fixture
def password_server(tmp_path):
    conf = tmp_path / "auth.conf"
    conf.write_text(f'authorization {{ user: "bob", password: "{PASSWORD}" }}\n')
    server = NatsServer(tmp_path / "store", extra_args=("-c", str(conf)), auth=False).start()   # its own users
    yield server
    server.stop()


def test_credentials_in_server_urls_are_redacted_everywhere(password_server, supervisor_factory):
    url = f"nats://bob:{PASSWORD}@127.0.0.1:{password_server.port}"
    sup = supervisor_factory(None, nats={"servers": [url]}, workers={"count": 1})
    sup.wait_ready(1)
    shown = run_cli("config", "show", "--config", str(sup.config_path), tmp=sup.tmp)
    assert shown.returncode == 0 and "nats://127.0.0.1:" in shown.stdout
    r = run_cli("publish", "--server", url, "--count", "2", "--data", "0", tmp=sup.tmp)
    assert r.returncode == 0, r.stderr
    wait_until(lambda: len(sup.jobs.done()) == 2, what="jobs done")
    outputs = [sup.log(), shown.stdout, shown.stderr, r.stdout, r.stderr, sup.get("/status")[1], sup.get("/metrics")[1]]
    wrong = run_cli("start", "--server", url.replace(PASSWORD, PASSWORD + "x"), "--http", "", tmp=sup.tmp,
                    env={"SUPERVISOR_NATS_STARTUP_TIMEOUT": "2"})
    assert wrong.returncode == 4 and "Authorization Violation" in wrong.stderr
    outputs += [wrong.stdout, wrong.stderr]
    assert sup.stop() == 0
    assert not [o for o in outputs + [sup.log()] if PASSWORD in o]


def non_loopback_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def test_scale_is_refused_from_a_non_loopback_client(nats_server, supervisor_factory):
    address = non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    # Port 0 (a port picked in advance may be taken before the supervisor binds it): the port it
    # bound on every address is in its log line, "status on http://0.0.0.0:PORT".
    sup = supervisor_factory(nats_server, workers={"count": 1}, monitor={"http": "0.0.0.0:0"})
    sup.wait_ready(1)
    port = sup.http.rpartition(":")[2]
    request = urllib.request.Request(f"http://{address}:{port}/scale?workers=3", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 403
    with urllib.request.urlopen(f"http://{address}:{port}/healthz", timeout=5) as ok:
        assert ok.status == 200                     # reading is fine from anywhere it listens
    request = urllib.request.Request(f"http://127.0.0.1:{port}/scale?workers=2", method="POST")
    with urllib.request.urlopen(request, timeout=5) as accepted:
        assert accepted.status == 202
    sup.wait_ready(2)
    assert sup.stop() == 0


def test_malformed_http_requests_get_4xx_and_the_supervisor_lives(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 1})
    sup.wait_ready(1)
    host, port = sup.http.split(":")
    for raw in (b"GARBAGE\r\n\r\n", b"GET /status\r\n\r\n", b"GET /nope HTTP/1.1\r\n\r\n",
                b"DELETE /status HTTP/1.1\r\n\r\n", b"POST /scale?workers=-1 HTTP/1.1\r\n\r\n",
                b"POST /scale?workers=abc HTTP/1.1\r\n\r\n", b"GET /" + b"x" * 70000 + b" HTTP/1.1\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(raw)
            reply = s.recv(200)
        assert reply.startswith(b"HTTP/1.1 4"), (raw[:40], reply)
    with socket.create_connection((host, int(port)), timeout=5):
        pass                                       # a client that connects and says nothing
    assert sup.get("/healthz")[0] == 200
    publish(sup.config["nats"]["servers"][0], count=1, data="0")
    wait_until(lambda: sup.jobs.done(), what="still working")
    assert sup.stop() == 0
