"""The FastStream peer: `faststream run bench.fs_app:app --workers N`.

Configured to do what the others do, no more and no less:
- one JetStream pull subscriber bound to the existing durable consumer (`durable="workers"`,
  `stream=JStream("JOBS", declare=False)`), pulling `PullSub(batch_size=BENCH_BATCH)` (256, the
  plain loop's batch), timeout 1 s;
- ack after the handler returned: `ack_policy=AckPolicy.REJECT_ON_ERROR`, FastStream's default
  (ack on success, term on an exception), written out so it is visible;
- its per-message logging off: the broker's service messages ("Received"/"Processed", two lines
  per job at INFO by default) go at DEBUG (`NatsBroker(log_level=logging.DEBUG)`), below the
  INFO level the CLI runs at, so they are never formatted; errors still log;
- everything else default (uvloop, chosen by `faststream run` when installed; FastDepends on).
"""

import logging
import os

from faststream import AckPolicy, FastStream
from faststream.nats import JStream, NatsBroker, PullSub

from bench.handlers import work
from bench.natsenv import CONSUMER, STREAM

broker = NatsBroker(os.environ.get("BENCH_NATS_URL", "nats://127.0.0.1:4222"), log_level=logging.DEBUG)
app = FastStream(broker)


@broker.subscriber("jobs.>", stream=JStream(STREAM, declare=False), durable=CONSUMER,
                   pull_sub=PullSub(batch_size=int(os.environ.get("BENCH_BATCH", "256")), timeout=1.0),
                   ack_policy=AckPolicy.REJECT_ON_ERROR)
async def handle(body: bytes) -> None:
    work(body, 1)           # the throughput and CPU scenarios only: no redelivery logic needed
