"""Handler modules the parent imports (it imports the handler to check it before forking), used
to put a fault into the parent itself (issue 22). Tests only. Workers inherit the patches by
fork; the tests that use these keep the workers' links up, where the patches change nothing."""

from testhandlers import full_buffer_when_down_init, record  # noqa: F401  (record: the handler)

# R9: nats-py refuses a publish while reconnecting once its reconnect buffer is full (2 MB, filled
# in production by fleet heartbeats during a long outage of the parent's link). Here it is "full"
# from the start of every disconnection: nats-py's own check raises, from its real state.
full_buffer_when_down_init()
