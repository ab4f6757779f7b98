"""One root for every error the supervisor reports to a user, each with its docs/CONTRACT.md exit code.

The CLI catches `SupervisorError` and prints `error: <message>` on one line; anything else
that escapes is a bug (exit 1) and keeps its traceback.
"""

EXIT_OK = 0
EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_HANDLER = 3
EXIT_NATS = 4
EXIT_HALTED = 5


class SupervisorError(Exception):
    exit_code = EXIT_BUG


class ConfigError(SupervisorError):
    """Usage or configuration error; the message names the key or flag."""

    exit_code = EXIT_USAGE

    def __init__(self, key: str, problem: str, source: str = ""):
        self.key, self.problem, self.source = key, problem, source
        where = f" (from {source})" if source else ""
        super().__init__(f"{key}: {problem}{where}")


class HandlerError(SupervisorError):
    """The handler or init hook cannot be imported or is not callable."""

    exit_code = EXIT_HANDLER


class NatsUnavailable(SupervisorError):
    """NATS unreachable within nats.startup_timeout, or stream/consumer cannot be ensured.
    `transient`: NATS did not answer (a timeout, a link that dropped, an election), so trying
    again may succeed, where a refusal will not."""

    exit_code = EXIT_NATS

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class Halted(SupervisorError):
    """Workers keep dying before they become ready."""

    exit_code = EXIT_HALTED
