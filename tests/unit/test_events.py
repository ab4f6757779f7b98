"""The event pipe's vocabulary (workers/protocol/events.py): every event survives the trip across
the pipe as itself, and anything else is a ValueError that says what is wrong."""

import pytest

from workers.protocol.events import (
    KINDS,
    AcksResent,
    PauseAsked,
    Ready,
    RecycleDue,
    Redelivered,
    Settled,
    Unsent,
    decode,
    encode,
)

EVERY = [Ready(), Redelivered(42, 2), Settled(42, 2, "nak", "table full"), Settled(7, 1, "ack"),
         Unsent(3, 1, "ack", "OutboundBufferLimitError"), AcksResent("leader elected", 5, 4, (11, 12)), RecycleDue(3),
         PauseAsked(30.0, "payments API down", 17)]


def test_every_kind_is_tested():
    assert {type(e) for e in EVERY} == set(KINDS.values())


@pytest.mark.parametrize("event", EVERY, ids=lambda e: e.kind)
def test_an_event_comes_back_as_itself(event):
    line = encode(event)
    assert line.endswith(b"\n") and b"\n" not in line[:-1]
    assert decode(line.rstrip(b"\n")) == event


@pytest.mark.parametrize("line, says", [
    (b'{"ev": "bogus"}', "not an event"),
    (b'[1, 2]', "not an event"),
    (b'{"ev": "redelivered", "seq": 1}', "redelivered"),
    (b'{"ev": "redelivered", "seq": "1", "delivery": 2}', "redelivered.seq: expected int"),
    (b'{"ev": "settled", "seq": 1, "delivery": 1, "outcome": "ack", "extra": 1}', "settled"),
])
def test_anything_else_is_a_value_error_saying_what(line, says):
    with pytest.raises(ValueError, match=says):
        decode(line)


def test_not_json_is_a_value_error():
    with pytest.raises(ValueError):
        decode(b"{half")
