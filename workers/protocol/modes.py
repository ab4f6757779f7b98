"""A worker's modes, shared by its loop (workers/runtime/worker.py) and its handler threads
(workers/runtime/threads.py), which read the mode under the worker's start_lock.

SERVING pulls and runs. RETIRING (SIGUSR1: scale down, recycle, a config roll) stops pulling and
runs what it already holds, so a routine retirement spends no delivery attempt and redelivers
nothing. STOPPING (SIGTERM: the supervisor stops, or graceful_timeout ran out) NAKs what has not
started and lets running jobs finish within graceful_timeout.
"""

SERVING, RETIRING, STOPPING = "serving", "retiring", "stopping"
