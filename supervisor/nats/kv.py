"""A KV bucket read as the stream it is: its keys from one StreamInfo (per-subject counts), for
the readers that must not depend on a KV watch (its "nothing pending" marker can come before an
entry the server already sent: nats-py reads num_pending before its handler saw the delivery)."""

from __future__ import annotations

from typing import Any


def stream_of(bucket: str) -> str:
    return f"KV_{bucket}"


def prefix_of(bucket: str) -> str:
    return f"$KV.{bucket}."


async def keys_under(js: Any, bucket: str, pattern: str) -> dict[str, int]:
    """Every key of `bucket` matching `pattern` (a subject wildcard after the bucket's prefix)
    that holds messages now, with how many (key -> count). Raises NotFoundError without the bucket."""
    prefix = prefix_of(bucket)
    info = await js.stream_info(stream_of(bucket), subjects_filter=prefix + pattern)
    return {s[len(prefix):]: n for s, n in (info.state.subjects or {}).items() if s.startswith(prefix)}
