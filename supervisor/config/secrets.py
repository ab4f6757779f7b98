"""Keeping secrets out of output: URLs with credentials, and known secret values in text."""

from __future__ import annotations

from collections.abc import Iterable


def redact_url(url: str) -> str:
    """`nats://user:pass@host:4222` -> `nats://host:4222` (a token in the userinfo goes too)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"   # NATS URLs have no path: any '@' ends userinfo


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """Replace every occurrence of each known secret with `***`, longest first."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text
