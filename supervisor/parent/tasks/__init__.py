"""The parent's tasks beside its loop: the monitor (ConsumerInfo, lag, advisories) and the fleet
(heartbeats, the poller lease, lost hosts). They read the arbiter's state and post changes to it;
they never change a worker."""
