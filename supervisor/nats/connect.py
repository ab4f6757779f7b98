"""Connect to NATS with whatever auth `[nats]` configures, and never leak a secret doing it.

Every auth mode of docs/CONTRACT.md maps onto nats-py 2.16 keyword arguments here:

| `[nats]` keys                   | nats-py                                   |
|---------------------------------|-------------------------------------------|
| user + password_file            | user=, password=                          |
| token_file                      | token=                                    |
| nkey_seed_file                  | nkeys_seed_str= (the seed, validated)     |
| creds_file                      | user_credentials=RawCredentials(...)      |
| tls_ca_file / tls_cert_file+key | tls=SSLContext, servers rewritten tls://  |

Secret files are read once, when the kwargs are built: a relative path is looked up in
$CREDENTIALS_DIRECTORY first (systemd LoadCredential=), a trailing newline is dropped, and a
file that group or others may read earns one warning. A missing or malformed file is a
`NatsConfigError` naming the key (exit 2), raised before any socket is opened.

Facts about nats-py this module is built around (checked against 2.16.0's source):
- TLS is driven by the server: nats-py upgrades the socket only when the server's INFO says
  `tls_required`. The `tls://` scheme does *not* make it insist on TLS (it only picks the scheme
  of discovered cluster URLs). So when TLS is configured we refuse a server that does not
  require it, and check that before the password or token is handed over (they are passed as
  callables that nats-py calls while writing CONNECT, after the TLS upgrade would have happened).
- The certificate is checked against the URL's host (or `tls_hostname`, which we do not set):
  a URL by IP address needs an IP SAN in the server certificate.
- `connect()` with reconnects allowed loops forever on its first connection when every server
  is down, whatever `max_reconnect_attempts` says (0 and -1 never give up). We connect with
  `allow_reconnect=False, max_reconnect_attempts=1` (at most two quick tries per server, auth
  or TLS errors fail at once), then switch the caller's reconnect policy on for the life of the
  connection: nats-py reads those options anew at every reconnect.
- The default error callback logs a full traceback per failed attempt; ours log one line with
  host:port only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import RawCredentials

from supervisor.config import NatsConfig
from supervisor.config.secrets import redact_text, redact_url
from supervisor.errors import ConfigError, NatsUnavailable
from supervisor.nats import fix as natsfix
from supervisor.nats.fix import Client

log = logging.getLogger("supervisor.nats")

# The [nats] keys that name a file holding a secret (group/other-readable ones are warned about).
SECRET_FILE_KEYS = ("password_file", "token_file", "nkey_seed_file", "creds_file", "tls_key_file")
AUTH_KEYS = ("creds_file", "nkey_seed_file", "token_file", "user")

_JWT_MARK = "BEGIN NATS USER JWT"
_SEED_MARK = "BEGIN USER NKEY SEED"

# (path, mode) pairs already warned about; inherited by forked workers so each warns once.
_warned_modes: set[tuple[str, int]] = set()


class NatsConfigError(ConfigError, ValueError):
    """A `[nats]` key is unusable: a secret file is missing, unreadable or malformed.

    `.key` is the dotted key, e.g. "nats.token_file"; the exit code is 2 (usage/config).
    """

    def __init__(self, key: str, problem: str):
        super().__init__(key, problem)


class NatsConnectError(NatsUnavailable):
    """One connection attempt to every configured server failed.

    The message names host:port and the server's or the socket's reason, never a credential.
    `.auth_failed` is True when the server rejected the credentials or the TLS peer, a failure
    that waiting will not cure (the caller may still retry until `nats.startup_timeout`).
    """

    def __init__(self, message: str, *, servers: Iterable[str] = (), auth_failed: bool = False):
        super().__init__(message)
        self.servers = tuple(servers)
        self.auth_failed = auth_failed


class TLSNotOfferedError(nats.errors.Error):
    """TLS is configured but the server did not require it: nothing secret was sent."""

    def __str__(self) -> str:
        return "server does not require TLS, but nats.tls_* or a tls:// URL is configured; refusing plaintext"


# ---------------------------------------------------------------- redaction (config/secrets.py)

def _url_secrets(servers: Iterable[str]) -> list[str]:
    found = []
    for url in servers:
        netloc = url.partition("://")[2] or url
        userinfo, at, _ = netloc.partition("/")[0].rpartition("@")
        if at and userinfo:
            user, colon, password = userinfo.partition(":")
            found.append(password if colon else user)  # no colon: the userinfo is a token
            found.append(userinfo)
    return [s for s in found if s]


# ---------------------------------------------------------------- files

def resolve_path(value: str) -> Path:
    """A relative path is taken from $CREDENTIALS_DIRECTORY when that file exists there."""
    path = Path(value).expanduser()
    creds_dir = os.environ.get("CREDENTIALS_DIRECTORY")
    if creds_dir and not path.is_absolute():
        candidate = Path(creds_dir) / path
        if candidate.exists():
            return candidate
    return path


def _read_file(key: str, value: str) -> tuple[Path, str]:
    path = resolve_path(value)
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise NatsConfigError(f"nats.{key}", f"{path} is not a regular file")
            data = f.read()
    except FileNotFoundError:
        raise NatsConfigError(f"nats.{key}", f"file {path} does not exist") from None
    except IsADirectoryError:
        raise NatsConfigError(f"nats.{key}", f"{path} is a directory, not a file") from None
    except PermissionError:
        raise NatsConfigError(f"nats.{key}", f"file {path} is not readable by uid {os.getuid()}") from None
    except OSError as e:
        raise NatsConfigError(f"nats.{key}", f"cannot read {path}: {e.strerror}") from None
    if key in SECRET_FILE_KEYS:
        _warn_if_exposed(key, path, mode)
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise NatsConfigError(f"nats.{key}", f"{path} is not UTF-8 text") from None
    return path, text


def _warn_if_exposed(key: str, path: Path, mode: int) -> None:
    perms = stat.S_IMODE(mode)
    if perms & 0o077 and (str(path), perms) not in _warned_modes:
        _warned_modes.add((str(path), perms))
        log.warning("nats.%s: %s has mode %04o, so group/others can read a secret; chmod 600 it",
                    key, path, perms)


def _read_secret(key: str, value: str) -> str:
    path, text = _read_file(key, value)
    text = text.rstrip("\r\n")
    if not text:
        raise NatsConfigError(f"nats.{key}", f"{path} is empty")
    return text


def _check_user_seed(key: str, seed: str) -> None:
    import nkeys

    if not seed.startswith("SU"):
        raise NatsConfigError(f"nats.{key}", "does not hold a user NKey seed (one starts with 'SU')")
    try:
        nkeys.from_seed(bytearray(seed.encode())).wipe()
    except Exception:  # nkeys raises its own error types, or binascii/nacl ones, for a bad seed
        raise NatsConfigError(f"nats.{key}", "holds a malformed NKey seed") from None


def _parse_creds(key: str, text: str) -> tuple[str, str]:
    """(user JWT, user seed) from a .creds file, tolerating CRLF and blank lines."""
    lines = [line.strip() for line in text.splitlines()]
    found: dict[str, str] = {}
    for i, line in enumerate(lines):
        for mark in (_JWT_MARK, _SEED_MARK):
            if mark in line and mark not in found:
                found[mark] = next((ln for ln in lines[i + 1:] if ln), "")
    jwt, seed = found.get(_JWT_MARK, ""), found.get(_SEED_MARK, "")
    if not jwt or not seed:
        raise NatsConfigError(f"nats.{key}", "is not a NATS .creds file (needs a user JWT and a user NKey seed)")
    if jwt.count(".") != 2:
        raise NatsConfigError(f"nats.{key}", "holds a malformed user JWT")
    _check_user_seed(key, seed)
    return jwt, seed


def _canonical_creds(jwt: str, seed: str) -> str:
    # The exact layout nats-py's parser expects (it reads the line after each BEGIN marker).
    return (f"-----{_JWT_MARK}-----\n{jwt}\n------END NATS USER JWT------\n\n"
            f"-----{_SEED_MARK}-----\n{seed}\n------END USER NKEY SEED------\n")


# ---------------------------------------------------------------- kwargs

def _cfg(nats_cfg: NatsConfig, name: str) -> str:
    return getattr(nats_cfg, name, "") or ""


def _auth_kwargs(nats_cfg: NatsConfig) -> tuple[dict[str, Any], list[str]]:
    chosen = [k for k in AUTH_KEYS if _cfg(nats_cfg, k)]
    if len(chosen) > 1:
        raise NatsConfigError(f"nats.{chosen[1]}",
                              f"conflicts with nats.{chosen[0]}; configure one auth method")
    if _cfg(nats_cfg, "password_file") and not _cfg(nats_cfg, "user"):
        raise NatsConfigError("nats.password_file", "needs nats.user")
    if not chosen:
        return {}, []
    method = chosen[0]
    if method == "user":
        if not _cfg(nats_cfg, "password_file"):
            raise NatsConfigError("nats.password_file", "is required with nats.user")
        password = _read_secret("password_file", nats_cfg.password_file)
        return {"user": nats_cfg.user, "password": password}, [password]
    if method == "token_file":
        token = _read_secret("token_file", nats_cfg.token_file)
        return {"token": token}, [token]
    if method == "nkey_seed_file":
        seed = _read_secret("nkey_seed_file", nats_cfg.nkey_seed_file).strip()
        _check_user_seed("nkey_seed_file", seed)
        return {"nkeys_seed_str": seed}, [seed]
    jwt, seed = _parse_creds("creds_file", _read_secret("creds_file", nats_cfg.creds_file))
    return {"user_credentials": RawCredentials(_canonical_creds(jwt, seed))}, [seed]


def _tls_wanted(nats_cfg: NatsConfig, servers: list[str]) -> bool:
    files = ("tls_ca_file", "tls_cert_file", "tls_key_file")
    return any(_cfg(nats_cfg, k) for k in files) or any(s.startswith("tls://") for s in servers)


def _tls_context(nats_cfg: NatsConfig) -> ssl.SSLContext:
    cert, key = _cfg(nats_cfg, "tls_cert_file"), _cfg(nats_cfg, "tls_key_file")
    if bool(cert) != bool(key):
        present, missing = ("tls_cert_file", "tls_key_file") if cert else ("tls_key_file", "tls_cert_file")
        raise NatsConfigError(f"nats.{missing}", f"is required with nats.{present} (mutual TLS takes both)")
    ca = _cfg(nats_cfg, "tls_ca_file")
    cafile = None
    if ca:
        cafile = _read_file("tls_ca_file", ca)[0]
    try:
        # With a cafile, only that CA is trusted (system CAs are not loaded).
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
    except ssl.SSLError as e:
        raise NatsConfigError("nats.tls_ca_file", f"{cafile} holds no usable CA certificate ({e.reason})") from None
    if cert:
        cert_path, cert_text = _read_file("tls_cert_file", cert)
        key_path, key_text = _read_file("tls_key_file", key)
        if "BEGIN CERTIFICATE" not in cert_text:
            raise NatsConfigError("nats.tls_cert_file", f"{cert_path} holds no PEM certificate")
        if "PRIVATE KEY" not in key_text:
            raise NatsConfigError("nats.tls_key_file", f"{key_path} holds no PEM private key")
        if "ENCRYPTED" in key_text:
            raise NatsConfigError("nats.tls_key_file", f"{key_path} is encrypted; give an unencrypted key (mode 0600)")
        try:
            ctx.load_cert_chain(cert_path, key_path)
        except ssl.SSLError as e:
            raise NatsConfigError("nats.tls_key_file",
                                  f"cannot load it with nats.tls_cert_file ({e.reason or 'SSL error'})") from None
    return ctx


def _tls_url(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return f"tls://{url}"
    return f"tls://{rest}" if scheme == "nats" else url


def _build(nats_cfg: NatsConfig) -> tuple[dict[str, Any], list[str]]:
    servers = [s for s in (getattr(nats_cfg, "servers", None) or [])]
    if not servers:
        raise NatsConfigError("nats.servers", "no server to connect to (empty means the embedded server; pass its URL)")
    kwargs, secrets = _auth_kwargs(nats_cfg)
    if _tls_wanted(nats_cfg, servers):
        kwargs["tls"] = _tls_context(nats_cfg)
        servers = [_tls_url(s) for s in servers]
    kwargs["servers"] = servers
    if _cfg(nats_cfg, "name"):
        kwargs["name"] = nats_cfg.name
    return kwargs, secrets + _url_secrets(servers)


def connect_kwargs(nats_cfg: NatsConfig) -> dict[str, Any]:
    """nats-py `connect()` keyword arguments (servers, name, auth, tls) for a `[nats]` config.

    Reads the secret files; raises `NatsConfigError` naming the key when one is unusable.
    Callbacks and timeouts are not included: `connect()` adds them.
    """
    return _build(nats_cfg)[0]


def secret_values(nats_cfg: NatsConfig) -> list[str]:
    """Every secret string the config leads to (for `redact_text`); unreadable files are skipped."""
    found = _url_secrets(getattr(nats_cfg, "servers", None) or [])
    for key, pick in (("password_file", None), ("token_file", None), ("nkey_seed_file", None),
                      ("creds_file", lambda t: _parse_creds("creds_file", t)[1])):
        if _cfg(nats_cfg, key):
            try:
                text = _read_secret(key, getattr(nats_cfg, key))
                found.append(pick(text) if pick else text)
            except NatsConfigError:
                continue  # nothing readable there, so nothing of it can leak
    return [s for s in found if s]


# ---------------------------------------------------------------- connecting

def _hostport(uri: Any) -> str:
    """host:port of a parsed server URI, without userinfo."""
    if uri is None or not getattr(uri, "hostname", None):
        return "?"
    host = uri.hostname
    return f"[{host}]:{uri.port}" if ":" in host else f"{host}:{uri.port}"


def _one_line(e: BaseException, secrets: list[str]) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, asyncio.TimeoutError) and not str(e):
        text = "timed out"
    text = " ".join(text.split())
    return redact_text(text, secrets)[:300]


def _is_auth_failure(e: BaseException) -> bool:
    return (isinstance(e, (nats.errors.AuthorizationError, ssl.SSLError, TLSNotOfferedError))
            or "authorization violation" in str(e).lower()
            or "authentication" in str(e).lower())


class _Events:
    """The connection's callbacks: one log line each, host:port only, secrets redacted."""

    def __init__(self, nc: Client, secrets: list[str]):
        self.nc, self.secrets = nc, secrets
        self.connecting = True       # first connect: errors are collected, not logged as warnings
        self.errors: list[BaseException] = []
        self.server = "?"            # host:port of the last server we were connected to
        self.failed_attempts = 0     # since the last disconnect
        self.last_error = ""

    def _current(self) -> str:
        uri = natsfix.current_server_uri(self.nc)
        return _hostport(uri) if uri is not None else self.server

    async def error_cb(self, e: Exception) -> None:
        text = _one_line(e, self.secrets)
        if self.connecting:
            self.errors.append(e)
            log.debug("NATS connect attempt failed: %s", text)  # the reason names host:port
            return
        self.failed_attempts += 1
        # While a server stays down the same error repeats every reconnect_time_wait: say it once.
        level = logging.DEBUG if text == self.last_error else logging.WARNING
        self.last_error = text
        log.log(level, "NATS error (%s): %s", self._current(), text)

    async def disconnected_cb(self) -> None:
        if self.connecting:
            return
        if self.nc.is_closed:
            log.debug("NATS connection to %s closed", self.server)
        else:
            self.failed_attempts, self.last_error = 0, ""
            log.warning("disconnected from NATS at %s; reconnecting", self.server,
                        extra={"event": "nats_disconnected", "server": self.server})

    async def reconnected_cb(self) -> None:
        self.server = _hostport(self.nc.connected_url)
        tries = f" after {self.failed_attempts} failed attempts" if self.failed_attempts else ""
        log.warning("reconnected to NATS at %s%s", self.server, tries,
                    extra={"event": "nats_reconnected", "server": self.server, "failed_attempts": self.failed_attempts})
        self.failed_attempts, self.last_error = 0, ""


_SSL_EOF_NOISE = "returning true from eof_received() has no effect when using ssl"


class _SslEofFilter(logging.Filter):
    """Drop asyncio's warning above, logged each time a TLS connection of nats-py's ends.

    nats-py's StreamReaderProtocol asks to keep the socket half open at EOF, which TLS cannot;
    asyncio says so on every close. Harmless, and it would read as a fault in our log.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != _SSL_EOF_NOISE


def _quiet_ssl_eof_warning() -> None:
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _SslEofFilter) for f in asyncio_log.filters):
        asyncio_log.addFilter(_SslEofFilter())


def _require_tls(nc: Client, value: Any) -> Callable[[], Any]:
    """Hand `value` to nats-py only once the server has required (hence started) TLS."""

    def get() -> Any:
        if not natsfix.server_info(nc).get("tls_required"):
            raise TLSNotOfferedError()
        return value

    return get


async def connect(nats_cfg: NatsConfig, *, name: str | None = None, max_reconnect_attempts: int = -1,
                  connect_timeout: float = 2.0, reconnect_time_wait: float = 2.0,
                  **options: Any) -> Client:
    """Connect once to the configured servers (one try each, no retry loop) and return the client.

    Raises `NatsConfigError` (exit 2) for an unusable key and `NatsConnectError` (exit 4 once
    the caller's `nats.startup_timeout` is spent) when no server accepted us. Once connected,
    the client reconnects per `max_reconnect_attempts` (-1: forever). `options` go to nats-py
    as they are (e.g. closed_cb, ping_interval).
    """
    natsfix.check_version()
    kwargs, secrets = _build(nats_cfg)
    if name:
        kwargs["name"] = name
    servers = kwargs["servers"]
    tls = "tls" in kwargs
    nc = Client()
    events = _Events(nc, secrets)
    if tls:
        _quiet_ssl_eof_warning()
        for k in ("password", "token"):
            if k in kwargs:
                kwargs[k] = _require_tls(nc, kwargs[k])
    kwargs.update(error_cb=events.error_cb, disconnected_cb=events.disconnected_cb,
                  reconnected_cb=events.reconnected_cb, connect_timeout=connect_timeout,
                  allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0)
    kwargs.update(options)
    client_cert = bool(_cfg(nats_cfg, "tls_cert_file"))
    try:
        await nc.connect(**kwargs)
    except (TimeoutError, OSError, nats.errors.Error) as e:
        error = _connect_error(servers, events.errors or [e], secrets, client_cert)
        natsfix.abandon(nc)
        raise error from e
    if tls and not natsfix.server_info(nc).get("tls_required"):
        # Only reachable with NKey/JWT auth (a nonce signature, no bearer secret, was sent).
        await nc.close()
        raise _connect_error(servers, [TLSNotOfferedError()], secrets, client_cert)
    nc.options.update(allow_reconnect=True, max_reconnect_attempts=max_reconnect_attempts,
                      reconnect_time_wait=reconnect_time_wait)
    events.connecting = False
    events.server = _hostport(nc.connected_url)
    log.info("connected to NATS at %s%s", events.server, " (TLS)" if tls else "")
    return nc


def _peer_refused(e: BaseException) -> bool:
    """The server ended the TLS session: an alert it sent (the reason names it: unknown ca,
    certificate required, bad certificate), or, with TLS 1.3, where a client certificate is
    judged after the handshake, a plain hang-up on the first read or write."""
    if isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLCertVerificationError):
        return "ALERT" in (e.reason or "").upper()
    return isinstance(e, (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError))


def _connect_error(servers: list[str], errors: list[BaseException], secrets: list[str],
                   client_cert: bool) -> NatsConnectError:
    # nats-py ends with NoServersError once every server failed; the reason is the error before.
    real = [e for e in errors if not isinstance(e, nats.errors.NoServersError)] or errors
    cause = real[-1]
    where = ", ".join(redact_url(s).partition("://")[2] or redact_url(s) for s in servers)
    reason = _one_line(cause, secrets)
    auth_failed = any(_is_auth_failure(e) for e in real)
    if client_cert and _peer_refused(cause):
        reason += "; the server may have rejected the client certificate (nats.tls_cert_file)"
        auth_failed = True
    return NatsConnectError(f"cannot connect to NATS at {where}: {reason}",
                            servers=[redact_url(s) for s in servers], auth_failed=auth_failed)
