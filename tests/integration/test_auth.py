"""Every `[nats]` auth mode against a real nats-server with JetStream: the right secret connects
and round-trips a PubAck, a wrong one fails with a clear error, and no secret is ever printed."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
import types

import natsauth
import pytest

from supervisor.errors import EXIT_NATS, EXIT_USAGE
from supervisor.nats import connect as natsconn
from supervisor.nats.connect import NatsConfigError, NatsConnectError

WRONG_REASON = {
    "user_password": "Authorization Violation",
    "token": "Authorization Violation",
    "nkey": "Authorization Violation",
    "creds": "Authorization Violation",
    "tls": "CERTIFICATE_VERIFY_FAILED",
    "mtls": "client certificate",
}


@pytest.fixture(scope="module", params=natsauth.MODES)
def auth_server(request, tmp_path_factory):
    """A running nats-server per auth mode, shared by the tests of this module."""
    with natsauth.nats_auth_server(request.param, tmp_path_factory.mktemp("auth")) as case:
        yield case


@pytest.fixture
def nats_log(caplog):
    caplog.set_level(logging.DEBUG, logger="supervisor.nats")
    return caplog


def assert_no_secret(secrets, *texts):
    assert secrets, "a case without secrets proves nothing"
    for text in texts:
        for secret in secrets:
            assert secret not in text


async def round_trip(cfg) -> tuple[object, bool]:
    nc = await natsconn.connect(cfg)
    try:
        js = nc.jetstream()
        await js.add_stream(name="AUTHTEST", subjects=["authtest.>"])
        ack = await js.publish("authtest.job", b"payload")
        return ack, bool(nc._server_info.get("tls_required"))
    finally:
        await nc.close()


def test_right_secret_connects_and_gets_puback(auth_server, nats_log, capfd):
    ack, tls = asyncio.run(round_trip(auth_server.config()))

    assert ack.stream == "AUTHTEST" and ack.seq >= 1
    assert tls == auth_server.mode.endswith("tls")
    assert f"connected to NATS at 127.0.0.1:{auth_server.port}" in nats_log.text
    out, err = capfd.readouterr()
    assert_no_secret(auth_server.all_secrets, nats_log.text, out, err)


def test_wrong_secret_fails_clearly_without_leaking(auth_server, nats_log, capfd):
    started = time.monotonic()
    with pytest.raises(NatsConnectError) as info:
        asyncio.run(natsconn.connect(auth_server.config(wrong=True)))

    assert time.monotonic() - started < 5, "a rejected secret must fail at once, not retry"
    err = info.value
    assert f"127.0.0.1:{auth_server.port}" in str(err)
    assert WRONG_REASON[auth_server.mode] in str(err)
    assert err.auth_failed and err.exit_code == EXIT_NATS
    assert "Traceback" not in nats_log.text
    assert all(r.exc_info is None for r in nats_log.records)
    out, errout = capfd.readouterr()
    assert_no_secret(auth_server.all_secrets, str(err), "".join(traceback.format_exception(err)),
                     nats_log.text, out, errout)


def test_connect_kwargs_shape(auth_server):
    kwargs = natsconn.connect_kwargs(auth_server.config())
    expected = {"user_password": {"user", "password"}, "token": {"token"},
                "nkey": {"nkeys_seed_str"}, "creds": {"user_credentials"},
                "tls": {"user", "password", "tls"}, "mtls": {"tls"}}[auth_server.mode]
    assert set(kwargs) == expected | {"servers", "name"}
    scheme = "tls" if "tls" in expected else "nats"
    assert kwargs["servers"] == [f"{scheme}://127.0.0.1:{auth_server.port}"]
    assert set(natsconn.secret_values(auth_server.config())) >= (
        set(auth_server.secrets) if auth_server.mode != "mtls" else set())


# ---------------------------------------------------------------- TLS policy

@pytest.mark.parametrize("mode", ["user_password", "token", "nkey", "creds"])
def test_tls_configured_but_server_plain_is_refused(tmp_path, nats_log, mode):
    """nats-py only upgrades when the server asks; with TLS configured we refuse plaintext
    (a password or token is withheld: nats-py asks for it only while writing CONNECT)."""
    tls = natsauth.make_case("tls", tmp_path)
    with natsauth.nats_auth_server(mode, tmp_path) as plain:
        cfg = plain.config(tls_ca_file=tls.nats["tls_ca_file"])
        with pytest.raises(NatsConnectError, match="does not require TLS") as info:
            asyncio.run(natsconn.connect(cfg))
    assert info.value.auth_failed
    assert_no_secret(plain.secrets, str(info.value), nats_log.text)


def test_password_is_never_written_to_a_plaintext_server(tmp_path):
    """A fake server that offers no TLS records every byte the client writes."""
    case = natsauth.make_case("tls", tmp_path)

    async def bytes_sent(**overrides) -> bytes:
        received, done = bytearray(), asyncio.Event()

        async def handle(reader, writer):
            writer.write(b'INFO {"server_id":"FAKE","version":"2.15.1","proto":1,'
                         b'"max_payload":1048576,"auth_required":true,"headers":true}\r\n')
            await writer.drain()
            while data := await reader.read(4096):
                received.extend(data)
            writer.close()
            done.set()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            with pytest.raises(NatsConnectError):
                await natsconn.connect(case.config(servers=(f"nats://127.0.0.1:{port}",), **overrides),
                                       connect_timeout=0.5)
            await asyncio.wait_for(done.wait(), 5)
        return bytes(received)

    password = case.secrets[0]
    assert password.encode() in asyncio.run(bytes_sent(tls_ca_file=""))  # the fake does capture it
    assert asyncio.run(bytes_sent()) == b""                               # TLS configured: nothing sent


def test_nats_urls_become_tls_when_tls_is_configured(tmp_path):
    case = natsauth.make_case("mtls", tmp_path)
    kwargs = natsconn.connect_kwargs(case.config(servers=("nats://a:4222", "b:4223", "tls://c:4224")))
    assert kwargs["servers"] == ["tls://a:4222", "tls://b:4223", "tls://c:4224"]


# ---------------------------------------------------------------- unreachable, reconnect

def test_unreachable_server_fails_fast_with_one_line(tmp_path, nats_log):
    port = natsauth.free_port()
    cfg = natsauth.make_case("token", tmp_path).config(servers=(f"nats://127.0.0.1:{port}",))
    started = time.monotonic()
    with pytest.raises(NatsConnectError, match=f"127.0.0.1:{port}") as info:
        asyncio.run(natsconn.connect(cfg))
    assert time.monotonic() - started < 5
    assert not info.value.auth_failed
    assert "Traceback" not in nats_log.text
    assert all(r.exc_info is None for r in nats_log.records)


def test_reconnects_after_server_restart_with_one_line_per_event(tmp_path, nats_log):
    async def scenario():
        # The first start may re-pick a port taken since make_case; the restart keeps it.
        with natsauth.nats_auth_server("creds", tmp_path) as case:
            nc = await natsconn.connect(case.config(), reconnect_time_wait=0.05)
        deadline = time.monotonic() + 10
        while nc.is_connected and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not nc.is_connected
        with natsauth.run_nats_server(case.conf_path):
            while not nc.is_connected and time.monotonic() < deadline + 10:
                await asyncio.sleep(0.01)
            js = nc.jetstream()
            await js.add_stream(name="AGAIN", subjects=["again.>"])
            ack = await js.publish("again.1", b"x")
        await nc.close()
        return case, ack

    case, ack = asyncio.run(scenario())
    assert ack.seq == 1
    text = nats_log.text
    assert f"disconnected from NATS at 127.0.0.1:{case.port}" in text
    assert f"reconnected to NATS at 127.0.0.1:{case.port}" in text
    warnings = [r for r in nats_log.records if r.levelno >= logging.WARNING]
    assert len(warnings) <= 5, [r.getMessage() for r in warnings]
    assert "Traceback" not in text and all(r.exc_info is None for r in nats_log.records)
    assert_no_secret(case.secrets, text)


def test_an_auth_server_port_taken_before_it_binds_is_picked_again(tmp_path, monkeypatch):
    """The case's port is picked before its server starts; one taken in between (held here, for
    real, by a listener a mere connect would mistake for the server) makes the server exit
    "address already in use", and the case is made again on a new port."""
    with natsauth.first_pick_taken(monkeypatch, natsauth) as held:
        with natsauth.nats_auth_server("token", tmp_path) as case:
            assert case.port != held and case.url.endswith(f":{case.port}")
            ack, _ = asyncio.run(round_trip(case.config()))
    assert ack.seq >= 1
    assert "address already in use" in case.server_log.read_text()


# ---------------------------------------------------------------- secret files

def test_permission_warning_for_group_readable_secret(tmp_path, nats_log):
    case = natsauth.make_case("token", tmp_path)
    token_file = case.nats["token_file"]
    natsconn.connect_kwargs(case.config())
    assert "chmod 600" not in nats_log.text

    os.chmod(token_file, 0o640)
    natsconn.connect_kwargs(case.config())
    natsconn.connect_kwargs(case.config())  # warned once per file and mode, not per connect
    warnings = [r.getMessage() for r in nats_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "nats.token_file" in warnings[0] and token_file in warnings[0] and "0640" in warnings[0]
    assert_no_secret(case.secrets, nats_log.text)


def test_secret_file_trailing_newline_is_stripped(tmp_path):
    path = natsauth.write_secret(tmp_path / "pw", "s3cret with space \r\n")
    kwargs = natsconn.connect_kwargs(_cfg(user="svc", password_file=str(path)))
    assert kwargs["password"] == "s3cret with space "


def test_relative_secret_resolved_in_credentials_directory(tmp_path, monkeypatch):
    creds_dir, cwd = tmp_path / "credentials", tmp_path / "cwd"
    creds_dir.mkdir(), cwd.mkdir()
    natsauth.write_secret(creds_dir / "nats-token", "from-systemd\n")
    natsauth.write_secret(cwd / "nats-token", "from-cwd\n")
    natsauth.write_secret(cwd / "only-here", "only-in-cwd\n")
    monkeypatch.chdir(cwd)

    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    assert natsconn.connect_kwargs(_cfg(token_file="nats-token"))["token"] == "from-cwd"

    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds_dir))
    assert natsconn.connect_kwargs(_cfg(token_file="nats-token"))["token"] == "from-systemd"
    # not there: the path stays relative to the working directory
    assert natsconn.connect_kwargs(_cfg(token_file="only-here"))["token"] == "only-in-cwd"
    # absolute paths are never redirected
    assert natsconn.connect_kwargs(_cfg(token_file=str(cwd / "nats-token")))["token"] == "from-cwd"


def test_credentials_directory_connects_for_real(auth_server, monkeypatch):
    """The systemd LoadCredential= layout: secrets by bare name in $CREDENTIALS_DIRECTORY."""
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(auth_server.dir))
    relative = {k: os.path.basename(v) for k, v in auth_server.nats.items()
                if k.endswith("_file") and v}
    ack, _ = asyncio.run(round_trip(auth_server.config(**relative)))
    assert ack.seq >= 1


@pytest.mark.parametrize("key", ["password_file", "token_file", "nkey_seed_file", "creds_file",
                                 "tls_ca_file", "tls_cert_file"])
def test_missing_file_is_a_config_error_naming_the_key(tmp_path, key):
    values = {key: str(tmp_path / "absent")}
    if key == "password_file":
        values["user"] = "svc"
    if key == "tls_cert_file":
        values["tls_key_file"] = str(natsauth.write_secret(tmp_path / "key.pem", natsauth.pki().client_key))
    with pytest.raises(NatsConfigError) as info:
        natsconn.connect_kwargs(_cfg(**values))
    assert info.value.key == f"nats.{key}"
    assert str(info.value).startswith(f"nats.{key}: ") and "absent" in str(info.value)
    assert info.value.exit_code == EXIT_USAGE and isinstance(info.value, ValueError)


@pytest.mark.parametrize("values, key, words", [
    ({"user": "svc"}, "nats.password_file", "required"),
    ({"password_file": "x"}, "nats.password_file", "nats.user"),
    ({"token_file": "a", "creds_file": "b"}, "nats.token_file", "conflicts with nats.creds_file"),
    ({"tls_cert_file": "c.pem"}, "nats.tls_key_file", "mutual TLS"),
    ({"tls_key_file": "k.pem"}, "nats.tls_cert_file", "mutual TLS"),
    ({"servers": ()}, "nats.servers", "no server"),
])
def test_inconsistent_config_is_named(values, key, words):
    with pytest.raises(NatsConfigError, match=words) as info:
        natsconn.connect_kwargs(_cfg(**values))
    assert info.value.key == key


def test_malformed_secret_files_are_named(tmp_path):
    bad_seed = natsauth.write_secret(tmp_path / "seed", "SUNOTAREALSEED\n")
    with pytest.raises(NatsConfigError, match="malformed NKey seed") as info:
        natsconn.connect_kwargs(_cfg(nkey_seed_file=str(bad_seed)))
    assert info.value.key == "nats.nkey_seed_file"
    assert "SUNOTAREALSEED" not in str(info.value)

    account_seed = natsauth.seed_of(natsauth.new_nkey(natsauth.nkeys.PREFIX_BYTE_ACCOUNT))
    natsauth.write_secret(bad_seed, account_seed)
    with pytest.raises(NatsConfigError, match="user NKey seed"):
        natsconn.connect_kwargs(_cfg(nkey_seed_file=str(bad_seed)))

    not_creds = natsauth.write_secret(tmp_path / "x.creds", "hello\n")
    with pytest.raises(NatsConfigError, match="not a NATS .creds file") as info:
        natsconn.connect_kwargs(_cfg(creds_file=str(not_creds)))
    assert info.value.key == "nats.creds_file"

    empty = natsauth.write_secret(tmp_path / "empty", "\n")
    with pytest.raises(NatsConfigError, match="empty"):
        natsconn.connect_kwargs(_cfg(token_file=str(empty)))

    with pytest.raises(NatsConfigError, match="directory"):
        natsconn.connect_kwargs(_cfg(token_file=str(tmp_path)))


def test_creds_with_crlf_line_endings(tmp_path):
    crlf = natsauth.write_secret(tmp_path / "crlf.creds", natsauth.trust().user_creds.replace("\n", "\r\n"))
    with natsauth.nats_auth_server("creds", tmp_path) as case:
        ack, _ = asyncio.run(round_trip(case.config(creds_file=str(crlf))))
    assert ack.seq >= 1


def test_mismatched_client_key_is_named(tmp_path):
    case = natsauth.make_case("mtls", tmp_path)
    other_key = case.wrong_nats["tls_key_file"]
    with pytest.raises(NatsConfigError) as info:
        natsconn.connect_kwargs(case.config(tls_key_file=other_key))
    assert info.value.key == "nats.tls_key_file"


# ---------------------------------------------------------------- redaction

@pytest.mark.parametrize("url, expected", [
    ("nats://user:pass@host:4222", "nats://host:4222"),
    ("nats://s3cr3tt0ken@10.0.0.1:4222", "nats://10.0.0.1:4222"),
    ("tls://u:p%40ss@nats.example.com:4443/path", "tls://nats.example.com:4443/path"),
    ("user:pass@host:4222", "host:4222"),
    ("nats://host:4222", "nats://host:4222"),
    ("nats://u:p@[::1]:4222", "nats://[::1]:4222"),
    ("host", "host"),
])
def test_redact_url(url, expected):
    assert natsconn.redact_url(url) == expected


def test_redact_text():
    text = "token abc123 and password hunter2, again abc123"
    assert natsconn.redact_text(text, ["abc123", "hunter2", ""]) == "token *** and password ***, again ***"
    # the longest secret is replaced first, so a secret containing another leaves no residue
    assert natsconn.redact_text("xx-abc123-yy", ["abc", "abc123"]) == "xx-***-yy"


def test_url_credentials_are_secret_values():
    cfg = _cfg(servers=("nats://svc:pw-in-url@h:4222", "nats://tok-in-url@h2:4222"))
    found = natsconn.secret_values(cfg)
    assert "pw-in-url" in found and "tok-in-url" in found


def _cfg(**values):
    base = {k: "" for k in natsauth.NATS_KEYS}
    base.update(servers=("nats://127.0.0.1:4222",), name="jetstream-supervisor", startup_timeout=1.0)
    base.update(values)
    return types.SimpleNamespace(**base)


def test_case_renders_as_supervisor_config(tmp_path):
    """The fixture's TOML and dict load into the real config dataclass and connect."""
    import dataclasses
    import tomllib

    from supervisor.config import NatsConfig

    with natsauth.nats_auth_server("mtls", tmp_path) as case:
        section = tomllib.loads(case.toml())["nats"]
        assert section["servers"] == [case.url] and "user" not in section
        cfg = dataclasses.replace(NatsConfig(), **{k: tuple(v) if isinstance(v, list) else v
                                                  for k, v in section.items()})
        ack, tls = asyncio.run(round_trip(cfg))
    assert ack.seq >= 1 and tls
