"""Example handlers, also used by the demo, the tests and the benchmarks."""

import os
import time

from . import Job


def sleep_job(job: Job) -> None:
    """Sleep float(payload) seconds, or 0.2 s when the payload is not a number."""
    try:
        seconds = float(job.data)
    except ValueError:
        seconds = 0.2
    time.sleep(max(0.0, seconds))


def noop(job: Job) -> None:
    """Do nothing: the throughput ceiling of the supervisor itself."""


def crash_on_marker(job: Job) -> None:
    """Exit the process without acking when the payload is `crash` (every time: a poison job)
    or `crash-once` (first delivery only: the demo's crash); else behave like sleep_job."""
    marker = job.data.strip()
    if marker == b"crash" or (marker == b"crash-once" and job.delivery == 1):
        os._exit(13)
    sleep_job(job)
