"""Fault injection against real nats-servers, checked by one ground-truth checker.

    python -m chaos [--quick] [--only NAME ...] [--repeat N] [--out DIR] [--keep]

A development tool like bench/ (not part of the installed distribution): run it from a
checkout. Each scenario (chaos/scenarios.py) starts its own nats-server(s) on free loopback
ports and the real `supervisor start`, publishes a steady load, injects its faults, lets the
queue settle and hands everything to chaos/checker.py, which reads the handlers' journal, the
PubAcks and the fault log, not the supervisor's word. docs/RELIABILITY.md has the figures.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The runner reuses the test harness (real nats-server, real supervisor, wait_until).
for _dir in ("support", "handlers"):      # the test suite's servers and supervisors, its handlers
    if str(REPO / "tests" / _dir) not in sys.path:
        sys.path.insert(0, str(REPO / "tests" / _dir))
