"""How a worker's exit reads to the parent: its exit codes."""

EXIT_DRAINED = 0
EXIT_INIT_FAILED = 3
EXIT_CONNECT_FAILED = 4
EXIT_CRASHED = 70
EXIT_ORPHANED = 71          # the supervisor and its embedded server are gone (nobody reads this one)
CHILD_EXIT_REASONS = {EXIT_INIT_FAILED: "init hook failed", EXIT_CONNECT_FAILED: "cannot reach NATS or bind the consumer",
                      EXIT_CRASHED: "worker crashed"}
