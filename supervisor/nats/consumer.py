"""ConsumerInfo as this project reads it: one flat dict of the numbers the seed post watches
(pending, ackPending, redelivered, delivered, ackFloor), shared by the monitor, `supervisor lag`
and the demo, and the one-line ticker they print."""

from __future__ import annotations

from typing import Any

from nats.js.errors import NotFoundError

from supervisor.errors import NatsUnavailable


async def consumer_info(js: Any, stream: str, consumer: str) -> dict[str, Any]:
    try:
        info = await js.consumer_info(stream, consumer)
    except NotFoundError:
        raise NatsUnavailable(f"consumer {consumer} not found on stream {stream}") from None
    return consumer_dict(info)


# What a ConsumerInfo poll adds to /status "consumer"; null until the first poll answers.
POLLED_KEYS = ("num_pending", "num_ack_pending", "num_redelivered", "num_waiting", "delivered_consumer_seq",
               "delivered_stream_seq", "ack_floor_consumer_seq", "ack_floor_stream_seq", "leader", "created",
               "paused_until", "pause_reason")


def consumer_dict(info: Any) -> dict[str, Any]:
    """`leader`: the server that answered (in a cluster, the consumer leader; None on a single
    server); `created` tells a recreated consumer from a leader move (supervisor/parent/tasks/monitor.py);
    `paused_until`: the consumer's PauseUntil while it is paused, else None (its reason, from the
    limits bucket, is the monitor's to add: supervisor/nats/limits.py)."""
    return {"stream": info.stream_name, "name": info.name, "num_pending": info.num_pending or 0,
            "num_ack_pending": info.num_ack_pending or 0, "num_redelivered": info.num_redelivered or 0,
            "num_waiting": info.num_waiting or 0, "delivered_consumer_seq": info.delivered.consumer_seq,
            "delivered_stream_seq": info.delivered.stream_seq, "ack_floor_consumer_seq": info.ack_floor.consumer_seq,
            "ack_floor_stream_seq": info.ack_floor.stream_seq,
            "leader": info.cluster.leader if info.cluster else None,
            "created": info.created.isoformat() if hasattr(info.created, "isoformat") else info.created,
            "paused_until": (info.config.pause_until or None) if getattr(info, "paused", False) else None,
            "pause_reason": ""}


def lag_line(c: dict[str, Any]) -> str:
    """The consumer's numbers as one ticker line (delivered and ackFloor are consumer sequences)."""
    return (f"pending={c['num_pending']:<4} ackPending={c['num_ack_pending']:<3} redelivered={c['num_redelivered']:<3} "
            f"delivered={c['delivered_consumer_seq']:<5} ackFloor={c['ack_floor_consumer_seq']}")
