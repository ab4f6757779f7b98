"""An HTTP client for a running supervisor (`status`, `scale`, the demos): its URL from --url or
monitor.http, one bounded request, one-line errors."""

from __future__ import annotations

import argparse
import http.client
import json
import urllib.error
import urllib.request
from http import HTTPStatus
from urllib.parse import urlsplit

from supervisor.config import from_args, parse_hostport
from supervisor.errors import EXIT_BUG, ConfigError, SupervisorError

HTTP_TIMEOUT = 5.0
# An unspecified listen address means "every interface"; the supervisor is reachable on loopback.
_ANY_HOST = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class SupervisorUnreachable(SupervisorError):
    """Nothing answers at the supervisor's HTTP address, or it answers with an error.

    Exit 1: docs/CONTRACT.md has no dedicated code for "the supervisor is not running"; 1 is the generic
    failure (2 stays "you typed something wrong", 4 stays "NATS")."""

    exit_code = EXIT_BUG


def supervisor_url(args: argparse.Namespace) -> str:
    """--url, else the effective monitor.http, as http://HOST:PORT (no trailing slash).
    The config is only read when --url is absent: a broken config must not hide a live supervisor."""
    if args.url:
        return base_url(args.url, "--url")
    http = from_args(args).monitor.http
    if not http:
        raise ConfigError("monitor.http", "is empty (the supervisor's HTTP endpoint is disabled); pass --url HOST:PORT")
    return base_url(http, "monitor.http")


def base_url(text: str, key: str) -> str:
    text = text.strip()
    if "://" not in text:
        host, hostport = parse_hostport(text, key)
        return f"http://{_bracket(_ANY_HOST.get(host, host))}:{hostport}"
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise ConfigError(key, f"expected HOST:PORT or http://HOST:PORT, got {text!r}")
    host = _bracket(_ANY_HOST.get(parts.hostname, parts.hostname))
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}{parts.path.rstrip('/')}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def http_call(base: str, method: str, path: str) -> tuple[int, str]:
    """(status code, body) from the supervisor; SupervisorUnreachable when nothing sensible answers.
    Proxies are bypassed: the supervisor is local (or reached directly), never through http_proxy."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(base + path, method=method, data=b"" if method == "POST" else None)
    try:
        with opener.open(request, timeout=HTTP_TIMEOUT) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except urllib.error.URLError as exc:
        reason = getattr(exc.reason, "strerror", None) or str(exc.reason)
        raise SupervisorUnreachable(f"no supervisor answers at {base} ({reason}); is `supervisor start` running "
                                    "there? (--url, or monitor.http in the config)") from None
    except (OSError, http.client.HTTPException) as exc:
        reason = f"no answer within {HTTP_TIMEOUT:g}s" if isinstance(exc, TimeoutError) else (
            str(exc) or type(exc).__name__)
        raise SupervisorUnreachable(f"{base}{path}: {reason}") from None


def http_reason(code: int) -> str:
    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return ""


def target_now(base: str, pool: str | None = None) -> int | None:
    """The target before scaling (a pool's, with `pool`), for the "(was N)" hint; None when
    /status does not say."""
    try:
        code, body = http_call(base, "GET", "/status")
        status = json.loads(body)
        workers = status["pools"][pool]["workers"] if pool else status["workers"]
        return int(workers["target"]) if code == 200 else None
    except (SupervisorUnreachable, ValueError, KeyError, TypeError):
        return None
