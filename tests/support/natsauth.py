"""Test support: real nats-servers (JetStream on) behind every auth mode of docs/CONTRACT.md `[nats]`.

Everything is generated in pure Python, once per process: a private CA with a server
certificate (127.0.0.1 / localhost) and a client certificate, a second CA for "wrong" client
certificates, NKeys, and operator/account/user JWTs with a `.creds` file.

    from natsauth import MODES, nats_auth_server

    with nats_auth_server("creds", tmp_path) as case:     # writes files, starts the server
        cfg = case.config()              # duck-typed [nats] object (right secret)
        bad = case.config(wrong=True)    # same, with a wrong secret
        case.toml()                      # "[nats]\\n..." for a supervisor config file
        case.secrets                     # strings that must never show up in any output

`make_case(mode, dir)` writes the files without starting anything; `run_nats_server(conf)`
starts a server from any config file and stops it on exit (use it again on the same conf to
restart a server on the same port).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import hashlib
import json
import os
import re
import socket
import subprocess
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nkeys

from supervisor.nats.embedded import find_binary as nats_server_binary  # noqa: F401 (re-exported)
from supervisor.nats.embedded import free_port

MODES = ("user_password", "token", "nkey", "creds", "tls", "mtls")

NATS_KEYS = ("servers", "user", "password_file", "token_file", "nkey_seed_file", "creds_file",
             "tls_ca_file", "tls_cert_file", "tls_key_file")


def write_secret(path: Path, data: str | bytes) -> Path:
    """Write a file readable by its owner only (0600, whatever the umask)."""
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, raw)
    finally:
        os.close(fd)
    return path


# ---------------------------------------------------------------- X.509

@dataclass(frozen=True)
class Pki:
    ca_cert: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes
    other_ca_cert: bytes        # a CA the server does not trust...
    other_client_cert: bytes    # ...and a client certificate it issued
    other_client_key: bytes


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _issue(subject_cn: str, *, issuer=None, issuer_key=None, ca: bool = False,
           server: bool = False, client: bool = False):
    """(key, cert): a self-signed CA when issuer is None, else a leaf signed by it."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(name)
               .issuer_name(issuer.subject if issuer else name)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(days=30))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=False, crl_sign=False, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=True,
            encipher_only=False, decipher_only=False), critical=True)
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + \
                 ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
    cert = builder.sign(issuer_key if issuer else key, hashes.SHA256())
    return key, cert


@functools.cache
def pki() -> Pki:
    ca_key, ca = _issue("jetstream-supervisor test CA", ca=True)
    srv_key, srv = _issue("localhost", issuer=ca, issuer_key=ca_key, server=True)
    cli_key, cli = _issue("supervisor-client", issuer=ca, issuer_key=ca_key, client=True)
    other_ca_key, other_ca = _issue("some other CA", ca=True)
    other_key, other = _issue("supervisor-client", issuer=other_ca, issuer_key=other_ca_key, client=True)
    return Pki(_pem_cert(ca), _pem_cert(srv), _pem_key(srv_key), _pem_cert(cli), _pem_key(cli_key),
               _pem_cert(other_ca), _pem_cert(other), _pem_key(other_key))


def pem_body_lines(pem: bytes) -> tuple[str, ...]:
    """The base64 lines of a PEM block: what would show if a private key leaked into a log."""
    return tuple(ln for ln in pem.decode().splitlines() if ln and not ln.startswith("-----"))


# ---------------------------------------------------------------- NKeys and JWTs

def new_nkey(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def seed_of(kp: nkeys.KeyPair) -> str:
    return bytes(kp.seed).decode()


def public_of(kp: nkeys.KeyPair) -> str:
    return kp.public_key.decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_jwt(issuer: nkeys.KeyPair, subject: str, name: str, nats_claims: dict) -> str:
    """A nats-io/jwt v2 JWT: header {typ: JWT, alg: ed25519-nkey}, signed by the issuer's NKey.

    `jti` is, as in jwt v2, base32(sha512/256(JSON of the standard claims with jti empty)).
    """
    std = {"iat": int(time.time()), "iss": public_of(issuer), "name": name, "sub": subject}
    jti = base64.b32encode(hashlib.new("sha512_256", _dumps(std)).digest()).rstrip(b"=").decode()
    claims = {"jti": jti, **std, "nats": {**nats_claims, "version": 2}}
    signing_input = f"{_b64(_dumps({'typ': 'JWT', 'alg': 'ed25519-nkey'}))}.{_b64(_dumps(claims))}"
    return f"{signing_input}.{_b64(issuer.sign(signing_input.encode()))}"


def operator_jwt(operator: nkeys.KeyPair, system_account: str) -> str:
    return encode_jwt(operator, public_of(operator), "test-operator",
                      {"type": "operator", "system_account": system_account})


def account_jwt(operator: nkeys.KeyPair, account: nkeys.KeyPair, name: str, *, jetstream: bool) -> str:
    limits = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
              "wildcards": True, "conn": -1, "leaf": -1}
    if jetstream:  # JetStream is on for an account whose mem or disk limit is non-zero
        limits.update(mem_storage=-1, disk_storage=-1, streams=-1, consumer=-1)
    return encode_jwt(operator, public_of(account), name,
                      {"type": "account", "limits": limits,
                       "default_permissions": {"pub": {}, "sub": {}}})


def user_jwt(account: nkeys.KeyPair, user: nkeys.KeyPair, name: str) -> str:
    return encode_jwt(account, public_of(user), name,
                      {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1})


def creds_text(jwt: str, seed: str) -> str:
    return (f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n"
            "*************************************************************\n")


@dataclass(frozen=True)
class Trust:
    operator_jwt: str
    system_account: str
    preload: dict            # account public key -> account JWT (resolver_preload)
    user_creds: str          # a user of the JetStream-enabled account
    user_seed: str
    unknown_creds: str       # a user of an account the server has never heard of
    unknown_seed: str
    nkey_seed: str           # a plain NKey user (nkey mode) ...
    nkey_public: str
    other_nkey_seed: str     # ... and one the server does not list


@functools.cache
def trust() -> Trust:
    op = new_nkey(nkeys.PREFIX_BYTE_OPERATOR)
    sys_acc = new_nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    app_acc = new_nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    stranger_acc = new_nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    user = new_nkey(nkeys.PREFIX_BYTE_USER)
    stranger = new_nkey(nkeys.PREFIX_BYTE_USER)
    plain, other = new_nkey(nkeys.PREFIX_BYTE_USER), new_nkey(nkeys.PREFIX_BYTE_USER)
    return Trust(
        operator_jwt=operator_jwt(op, public_of(sys_acc)),
        system_account=public_of(sys_acc),
        preload={public_of(sys_acc): account_jwt(op, sys_acc, "SYS", jetstream=False),
                 public_of(app_acc): account_jwt(op, app_acc, "APP", jetstream=True)},
        user_creds=creds_text(user_jwt(app_acc, user, "supervisor"), seed_of(user)),
        user_seed=seed_of(user),
        unknown_creds=creds_text(user_jwt(stranger_acc, stranger, "stranger"), seed_of(stranger)),
        unknown_seed=seed_of(stranger),
        nkey_seed=seed_of(plain), nkey_public=public_of(plain), other_nkey_seed=seed_of(other),
    )


def new_secret() -> str:
    """Hex: no quoting trouble in a nats-server config, never mistaken for a bcrypt hash."""
    return os.urandom(16).hex()


# ---------------------------------------------------------------- cases

@dataclass(frozen=True)
class AuthCase:
    """One auth mode: a nats-server config file plus the `[nats]` settings that reach it."""

    mode: str
    dir: Path
    conf_path: Path
    port: int
    url: str                                  # as the supervisor should use it
    nats: dict                                # the [nats] section (all NATS_KEYS; "" = unset)
    wrong_nats: dict                          # the same with a wrong secret
    secrets: tuple[str, ...]                  # must not appear in any output
    wrong_secrets: tuple[str, ...] = ()       # the wrong variant's secrets (must not leak either)
    server_log: Path = field(default=Path())  # nats-server's stderr while run_nats_server runs

    @property
    def servers(self) -> list[str]:
        return [self.url]

    @property
    def store_dir(self) -> Path:
        return self.dir / "jetstream"

    @property
    def all_secrets(self) -> tuple[str, ...]:
        return self.secrets + self.wrong_secrets

    def section(self, wrong: bool = False) -> dict:
        return dict(self.wrong_nats if wrong else self.nats)

    def config(self, wrong: bool = False, **overrides) -> types.SimpleNamespace:
        """A duck-typed [nats] config object, every key present (the contract's defaults for the rest)."""
        values = {"name": "jetstream-supervisor", "startup_timeout": 5.0, **self.section(wrong), **overrides}
        values["servers"] = tuple(values["servers"])
        return types.SimpleNamespace(**values)

    def toml(self, wrong: bool = False) -> str:
        """The `[nats]` table for a supervisor config file (only the keys that are set)."""
        import tomli_w

        section = {k: v for k, v in self.section(wrong).items() if v}
        return tomli_w.dumps({"nats": section})


def _nats_section(url: str, **values: str) -> dict:
    section = {k: "" for k in NATS_KEYS}
    section["servers"] = [url]
    section.update({k: str(v) for k, v in values.items()})
    return section


def _server_conf(port: int, store_dir: Path, body: str) -> str:
    return (f"listen: 127.0.0.1:{port}\n"
            f"jetstream {{\n  store_dir: {json.dumps(str(store_dir))}\n"
            "  max_memory_store: 64MB\n  max_file_store: 256MB\n}\n"
            f"{body}")


def _q(value: str | Path) -> str:
    return json.dumps(str(value))  # a nats-server config string: double quotes, JSON escapes


def _case_dir(base: Path, mode: str) -> Path:
    d = Path(base) / mode
    d.mkdir(parents=True, exist_ok=True)
    return d


def _case(d: Path, server_auth: str, *, scheme: str = "nats", nats: dict, wrong_nats: dict,
          **rest) -> AuthCase:
    port = free_port()
    conf = d / "nats-server.conf"
    conf.write_text(_server_conf(port, d / "jetstream", server_auth))
    url = f"{scheme}://127.0.0.1:{port}"
    return AuthCase(mode=d.name, dir=d, conf_path=conf, port=port, url=url,
                    nats=_nats_section(url, **nats), wrong_nats=_nats_section(url, **wrong_nats),
                    server_log=d / "nats-server.log", **rest)


def user_password_case(base: Path) -> AuthCase:
    password, wrong = new_secret(), new_secret()
    d = _case_dir(base, "user_password")
    return _case(d, f"authorization {{\n  user: \"svc\"\n  password: {_q(password)}\n}}\n",
                 nats={"user": "svc", "password_file": write_secret(d / "password", password + "\n")},
                 wrong_nats={"user": "svc", "password_file": write_secret(d / "wrong-password", wrong + "\n")},
                 secrets=(password,), wrong_secrets=(wrong,))


def token_case(base: Path) -> AuthCase:
    token, wrong = new_secret(), new_secret()
    d = _case_dir(base, "token")
    return _case(d, f"authorization {{\n  token: {_q(token)}\n}}\n",
                 nats={"token_file": write_secret(d / "token", token + "\n")},
                 wrong_nats={"token_file": write_secret(d / "wrong-token", wrong + "\n")},
                 secrets=(token,), wrong_secrets=(wrong,))


def nkey_case(base: Path) -> AuthCase:
    t = trust()
    d = _case_dir(base, "nkey")
    return _case(d, f"authorization {{\n  users: [\n    {{ nkey: {_q(t.nkey_public)} }}\n  ]\n}}\n",
                 nats={"nkey_seed_file": write_secret(d / "user.nk", t.nkey_seed + "\n")},
                 wrong_nats={"nkey_seed_file": write_secret(d / "other.nk", t.other_nkey_seed + "\n")},
                 secrets=(t.nkey_seed,), wrong_secrets=(t.other_nkey_seed,))


def creds_case(base: Path) -> AuthCase:
    """Operator mode: operator JWT, MEMORY resolver preloaded with SYS and the JetStream account."""
    t = trust()
    d = _case_dir(base, "creds")
    op = d / "operator.jwt"
    op.write_text(t.operator_jwt)
    preload = "".join(f"  {k}: {_q(v)}\n" for k, v in t.preload.items())
    server_auth = (f"operator: {_q(op)}\nsystem_account: {t.system_account}\n"
                   f"resolver: MEMORY\nresolver_preload: {{\n{preload}}}\n")
    return _case(d, server_auth,
                 nats={"creds_file": write_secret(d / "user.creds", t.user_creds)},
                 wrong_nats={"creds_file": write_secret(d / "unknown.creds", t.unknown_creds)},
                 secrets=(t.user_seed,), wrong_secrets=(t.unknown_seed,))


def _write_pki(d: Path) -> dict[str, Path]:
    p = pki()
    public = {"ca": p.ca_cert, "server-cert": p.server_cert, "client-cert": p.client_cert,
              "other-ca": p.other_ca_cert, "other-client-cert": p.other_client_cert}
    private = {"server-key": p.server_key, "client-key": p.client_key,
               "other-client-key": p.other_client_key}
    out = {}
    for name, data in public.items():
        out[name] = d / f"{name}.pem"
        out[name].write_bytes(data)
    for name, data in private.items():
        out[name] = write_secret(d / f"{name}.pem", data)
    return out


def _server_tls(files: dict[str, Path]) -> str:
    """The opening of a server `tls {}` block (the caller closes it)."""
    return (f"tls {{\n  cert_file: {_q(files['server-cert'])}\n  key_file: {_q(files['server-key'])}\n"
            "  timeout: 2\n")


def tls_case(base: Path) -> AuthCase:
    """Server-side TLS (private CA) plus user/password; the wrong variant trusts another CA."""
    password = new_secret()
    d = _case_dir(base, "tls")
    f = _write_pki(d)
    pw = write_secret(d / "password", password + "\n")
    server_auth = (_server_tls(f) + "}\n"
                   f"authorization {{\n  user: \"svc\"\n  password: {_q(password)}\n}}\n")
    return _case(d, server_auth,
                 scheme="tls",
                 nats={"user": "svc", "password_file": pw, "tls_ca_file": f["ca"]},
                 wrong_nats={"user": "svc", "password_file": pw, "tls_ca_file": f["other-ca"]},
                 secrets=(password,))


def mtls_case(base: Path) -> AuthCase:
    """Mutual TLS: the server verifies client certificates against the private CA."""
    d = _case_dir(base, "mtls")
    f = _write_pki(d)
    p = pki()
    server_auth = _server_tls(f) + f"  ca_file: {_q(f['ca'])}\n  verify: true\n}}\n"
    return _case(d, server_auth,
                 scheme="tls",
                 nats={"tls_ca_file": f["ca"], "tls_cert_file": f["client-cert"],
                       "tls_key_file": f["client-key"]},
                 wrong_nats={"tls_ca_file": f["ca"], "tls_cert_file": f["other-client-cert"],
                             "tls_key_file": f["other-client-key"]},
                 secrets=pem_body_lines(p.client_key),
                 wrong_secrets=pem_body_lines(p.other_client_key))


CASES: dict[str, Callable[[Path], AuthCase]] = {
    "user_password": user_password_case, "token": token_case, "nkey": nkey_case,
    "creds": creds_case, "tls": tls_case, "mtls": mtls_case,
}


def make_case(mode: str, base: Path) -> AuthCase:
    """Write the server config and client files for `mode` under `base/mode/`."""
    return CASES[mode](Path(base))


# ---------------------------------------------------------------- running a server

@dataclass
class NatsServer:
    proc: subprocess.Popen
    port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _conf_port(conf_path: Path) -> int:
    m = re.search(r"^\s*listen\s*[:=]\s*\"?[\w.\[\]:-]*?:(\d+)", Path(conf_path).read_text(), re.M)
    if not m:
        raise ValueError(f"{conf_path}: no 'listen: HOST:PORT' line")
    return int(m.group(1))


@contextlib.contextmanager
def first_pick_taken(monkeypatch: Any, module: Any) -> Iterator[int]:
    """A port held for real (bound, listening: a mere connect would take it for a server) that
    `module.free_port` hands out first, as when any socket takes a picked port before the process
    it was picked for binds it. Yields the held port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        picks, real = iter([held]), module.free_port
        monkeypatch.setattr(module, "free_port", lambda *args: next(picks, 0) or real(*args))
        yield held


class PortTaken(RuntimeError):
    """nats-server exited "address already in use": its port, picked free a moment earlier, was
    taken before it could bind it (by any socket, an outgoing connection's included)."""


@contextlib.contextmanager
def run_nats_server(conf_path: Path | str, *, timeout: float = 15.0,
                    log_path: Path | None = None) -> Iterator[NatsServer]:
    """Start nats-server -c conf, wait until it logs that it listens on the conf's port, yield,
    always stop it. Its own log line, not a connect: if its port was taken, a connect would
    reach whoever took it (and this server exits; PortTaken)."""
    conf_path = Path(conf_path)
    port = _conf_port(conf_path)
    log_path = log_path or conf_path.with_suffix(".log")
    logged = log_path.stat().st_size if log_path.exists() else 0      # a restart appends to the same log
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen([nats_server_binary(), "-c", str(conf_path)],
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)
    server = NatsServer(proc, port, log_path)
    listening = re.compile(rf"Listening for client connections on \S+:{port}\b")
    try:
        deadline = time.monotonic() + timeout
        delay = 0.005
        while not listening.search(said := log_path.read_bytes()[logged:].decode(errors="replace")):
            if proc.poll() is not None:
                error = PortTaken if "address already in use" in said else RuntimeError
                raise error(f"nats-server exited with {proc.returncode}:\n{said[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not listen on port {port} within {timeout}s:\n{said[-3000:]}")
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        yield server
    finally:
        stop_nats_server(proc)


def stop_nats_server(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def nats_auth_server(mode: str, base: Path | str) -> Iterator[AuthCase]:
    """make_case + run_nats_server: a running server for `mode`, stopped on exit. The port
    make_case picked may be taken before the server binds it: then the case is made again, on a
    new port (no client has it yet; a restart with run_nats_server keeps its port)."""
    with contextlib.ExitStack() as running:
        for attempt in range(1, 4):
            case = make_case(mode, Path(base))
            try:
                running.enter_context(run_nats_server(case.conf_path, log_path=case.server_log))
                break
            except PortTaken:
                if attempt == 3:
                    raise
        yield case
