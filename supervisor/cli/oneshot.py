"""What every one-shot command shares: one bounded connection attempt (a mistyped server
must fail in a moment, not after the daemon's `nats.startup_timeout`: exit 4), the default
subject, one-line errors."""

from __future__ import annotations

import asyncio
from typing import Any

from supervisor.config import Config, subjects
from supervisor.errors import NatsUnavailable
from supervisor.nats import connect as natsconn


async def connect_oneshot(cfg: Config, purpose: str) -> Any:
    """One connection attempt, bounded by nats.connect_timeout; NatsUnavailable (exit 4) names
    the servers and the reason."""
    limit = cfg.nats.connect_timeout
    try:
        return await asyncio.wait_for(natsconn.connect(cfg.nats, name=f"{cfg.nats.name} {purpose}",
                                                       connect_timeout=limit), limit)
    except TimeoutError:
        where = ", ".join(natsconn.redact_url(s).partition("://")[2] for s in cfg.nats.servers)
        raise NatsUnavailable(f"cannot connect to NATS at {where}: no answer within "
                              f"nats.connect_timeout={limit:g}s") from None


def default_subject(cfg: Config) -> str:
    return subjects.default_subject(cfg.stream.subjects)



def one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
