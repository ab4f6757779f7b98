"""The `supervisor` command line. Flags map onto config keys; defaults live only in config.py.

The global flags (--config, --server, --log-format) are accepted before or after the command
name. argparse copies every attribute a command's parser sets over the top-level namespace, so
a command-level default of None would silently erase `supervisor --config x lag`'s value: at
command level the globals have SUPPRESS defaults and their own names, and `merge_globals`
folds the two places together (after the command wins; --server from both places adds up).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from supervisor import __version__, config, logs
from supervisor.errors import EXIT_BUG, EXIT_OK, ConfigError, SupervisorError

GLOBALS = ("config", "server", "log_format")
AFTER = "cmd_"               # dest prefix of a global flag given after the command name

CONFIG_HELP = "config file (else $SUPERVISOR_CONFIG, else ./config.toml when present, else built-in defaults)"
SERVER_HELP = "NATS server URL, e.g. nats://nats-1:4222 (repeatable; overrides nats.servers)"
LOG_FORMAT_HELP = "log lines as text or JSON objects (log.format)"

TOP_EPILOG = """\
examples:
  supervisor demo                                  # see it work: embedded server, 3 workers, 30 jobs, one crash
  supervisor start --handler myjobs:handle         # run your handler in 4 workers (embedded server, kept state)
  supervisor publish --count 40 --data 0.5         # queue 40 jobs
  supervisor lag --watch 1                         # the consumer's numbers once a second
  supervisor status                                # a running supervisor's workers, lag and crash check
  supervisor --server nats://nats-1:4222 lag       # global flags go before or after the command

Run `supervisor COMMAND --help` for a command's options and examples.
Exit codes: 0 ok, 1 bug (or: no supervisor answers), 2 usage/config error, 3 handler cannot be
imported, 4 NATS unreachable or stream/consumer cannot be ensured, 5 workers crash at boot.
"""

LAG_COLUMNS = """\
The consumer's numbers (ConsumerInfo), all counted by the consumer:
  pending      jobs in the stream not yet delivered to any worker
  ackPending   delivered and not yet acked (in flight)
  redelivered  jobs in flight that were delivered more than once (0 again once they are acked)
  delivered    deliveries so far, redeliveries included (the consumer sequence)
  ackFloor     the consumer sequence up to which everything is acked
"""

EPILOGS = {
    "start": """\
examples:
  supervisor start --handler myjobs:handle                  # embedded nats-server, 4 workers
  supervisor start --config /etc/jetstream-supervisor/config.toml
  supervisor start --server nats://nats-1:4222 --server nats://nats-2:4222 --workers 8 --handler myjobs:handle
  supervisor start --handler workers.examples:sleep_job     # an example handler, to try things out

The handler is a function MODULE:FUNC taking a workers.Job; returning acks the job. With no
nats.servers the embedded nats-server keeps its store in $STATE_DIRECTORY or
$XDG_STATE_HOME/jetstream-supervisor, so waiting jobs survive a restart.
SIGTERM/SIGINT drain and stop; SIGHUP reloads the config; SIGTTIN/SIGTTOU add/remove a worker
(in every pool). With [pools.NAME] in the config, --pool NAME runs only that pool (repeatable).
""",
    "publish": """\
examples:
  supervisor publish                                 # one job, payload job-1
  supervisor publish --count 40 --data 0.5           # 40 jobs (sleep_job sleeps float(payload) seconds)
  supervisor publish --count 1000 --rate 50 --msg-id batch7   # deduplicated by the server if re-run
  supervisor publish --delay 600 --data report-42    # stored now, delivered in ten minutes
  supervisor publish --at 2026-12-24T18:00:00Z       # delivered then (the server's clock)
""",
    "lag": """\
examples:
  supervisor lag
  supervisor lag --watch 1                           # a ticker with a time column
  supervisor lag --json

""" + LAG_COLUMNS,
    "status": """\
examples:
  supervisor status                                  # the supervisor at monitor.http of the config
  supervisor status --url 127.0.0.1:9520 --json
  supervisor status --fleet                          # every supervisor on the consumer, from NATS
""",
    "pause": """\
examples:
  supervisor pause --for 300 --reason "payments API down"   # every supervisor on the consumer
  supervisor pause                                   # until `supervisor resume`
""",
    "resume": """\
examples:
  supervisor resume                                  # deliveries start again now, fleet-wide
  supervisor --server nats://nats-1:4222 resume      # a fleet's consumer, from any host
""",
    "scale": """\
examples:
  supervisor scale 8                                 # 8 workers from now on (until a restart)
  supervisor scale 0 --url 10.0.0.5:9520             # drain every worker, keep the supervisor
  supervisor scale 3 --pool email                    # with [pools.NAME]: one pool's count
""",
    "config": """\
examples:
  supervisor config init                             # write ./config.toml, every key commented
  supervisor config check --config /etc/jetstream-supervisor/config.toml
  supervisor config show                             # the effective config, secrets redacted
""",
    "config init": """\
examples:
  supervisor config init
  supervisor config init /etc/jetstream-supervisor/config.toml --force
""",
    "config show": """\
example:
  SUPERVISOR_WORKERS_COUNT=8 supervisor config show  # defaults < file < environment < flags
""",
    "config check": """\
Checks the file, the environment, the secret files and imports workers.handler,
workers.init and workers.middleware. Exit 0 when `supervisor start` would accept it, 2 for a
config error, 3 when the handler (or a middleware) cannot be imported or does not fit.

example:
  supervisor config check --config /etc/jetstream-supervisor/config.toml
""",
    "dlq": """\
Dead letters are jobs the supervisor gave up on: a handler raised Reject, a job reached
consumer.max_deliver, or a job was running at restart.poison_after_crashes worker deaths. They
are kept in restart.dead_letter_stream with where they came from and why.

examples:
  supervisor dlq list
  supervisor dlq list --json --limit 10
  supervisor dlq replay --seq 3 4                    # run dead letters 3 and 4 again
  supervisor dlq replay --all --subject jobs.retry   # everything, to another subject
""",
    "dlq list": """\
examples:
  supervisor dlq list                                # oldest first
  supervisor dlq list --json --limit 10
""",
    "dlq replay": """\
Each dead letter is published again (with its original headers) and removed from the dead-letter
stream once the server has stored the copy. A replay cut short is safe to run again: the copy
carries a Nats-Msg-Id made from the dead letter, so the stream drops a second copy (within
stream.duplicate_window).

examples:
  supervisor dlq replay --seq 3                      # N: the number in the first column of `dlq list`
  supervisor dlq replay --all
  supervisor dlq replay --all --subject jobs.retry
""",
    "schedule": """\
A schedule is kept in the stream and fired by the server, once per period for the whole fleet:
no beat process, and two supervisors never double it. [schedules.NAME] in the config is what
`start` makes the server hold (added, changed, removed); `schedule add` makes one by hand that
`start` leaves alone.

examples:
  supervisor schedule list
  supervisor schedule add cleanup --every 300 --subject jobs.cleanup
  supervisor schedule add report --cron "0 7 * * 1-5" --data weekly     # 07:00 UTC, Monday to Friday
  supervisor schedule rm cleanup
""",
    "schedule list": """\
MADE BY is config ([schedules.NAME], reconciled by `start`) or cli (`schedule add`).

examples:
  supervisor schedule list
  supervisor schedule list --json
""",
    "schedule add": """\
examples:
  supervisor schedule add cleanup --every 300 --subject jobs.cleanup
  supervisor schedule add nightly --cron "30 2 * * *" --header "Tenant: acme"
""",
    "schedule rm": """\
example:
  supervisor schedule rm cleanup
""",
    "demo": """\
Starts its own supervisor on an embedded nats-server in a temporary directory (free ports, removed
at the end), publishes the jobs, crashes one worker while it holds a job and shows the job coming
back at once instead of after AckWait. Exit 0 only if every job was acked.

examples:
  supervisor demo
  supervisor demo --workers 5 --jobs 100
  supervisor demo --dashboard                        # then watch it at the printed URL until Ctrl-C
  supervisor demo --scenario once                    # a crash after the side effect, recorded once all the same
""",
}


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:   # usage errors exit 2, in one line
        self.print_usage(sys.stderr)
        raise ConfigError(self.prog, message)


def add_globals(p: argparse.ArgumentParser, after: bool) -> None:
    """--config, --server, --log-format: on the top-level parser, and again on every command."""
    prefix, default = (AFTER, argparse.SUPPRESS) if after else ("", None)
    g = p.add_argument_group("global options (before or after the command)")
    g.add_argument("--config", dest=prefix + "config", metavar="PATH", default=default, help=CONFIG_HELP)
    g.add_argument("--server", dest=prefix + "server", metavar="URL", action="append", default=default,
                   help=SERVER_HELP)
    g.add_argument("--log-format", dest=prefix + "log_format", choices=("text", "json"), default=default,
                   help=LOG_FORMAT_HELP)


def merge_globals(args: argparse.Namespace) -> argparse.Namespace:
    for name in GLOBALS:
        after = getattr(args, AFTER + name, None)
        if hasattr(args, AFTER + name):
            delattr(args, AFTER + name)
        if name == "server":
            setattr(args, name, [*(args.server or []), *(after or [])] or None)
        elif after is not None:
            setattr(args, name, after)
    return args


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="supervisor", epilog=TOP_EPILOG,
                            description="A process supervisor for NATS JetStream work queues: worker processes share "
                                        "one durable\npull consumer, and a crashed worker's jobs come back at once.")
    parser.add_argument("--version", action="version", version=f"jetstream-supervisor {__version__}",
                        help="print the version and exit")
    add_globals(parser, after=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=ArgumentParser)

    def command(name: str, help: str, parent: Any = sub, key: str | None = None) -> ArgumentParser:
        p = parent.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                              epilog=EPILOGS.get(key or name))
        add_globals(p, after=True)
        return p

    p = command("start", "run the supervisor in the foreground")
    p.add_argument("--workers", type=int, metavar="N", help="worker processes (workers.count)")
    p.add_argument("--handler", metavar="MOD:FUNC", help="the function that runs each job (workers.handler)")
    p.add_argument("--http", metavar="HOST:PORT", help="address of /status, /metrics, /healthz (monitor.http); "
                                                      "'' disables")
    p.add_argument("--pool", action="append", metavar="NAME", help="run only this pool of the config's [pools.NAME] "
                                                                   "(repeatable; default: every pool)")

    p = command("publish", "publish jobs and wait until the server has stored each")
    p.add_argument("--subject", help="subject to publish to (default: the stream's first subject, '>' as 'new', "
                                     "e.g. jobs.new)")
    p.add_argument("--count", type=int, default=1, metavar="N", help="how many jobs (default 1)")
    p.add_argument("--data", default="job-{i}", metavar="TEXT", help="payload; {i} is the job number (default job-{i})")
    p.add_argument("--msg-id", metavar="PREFIX", help="set Nats-Msg-Id: PREFIX-<i>, so the server drops a job "
                                                      "published twice (within stream.duplicate_window)")
    p.add_argument("--rate", type=float, metavar="PER_S", help="publish at most this many per second")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--delay", type=float, metavar="SECONDS", help="store now, deliver SECONDS later (a NATS "
                                                                    "message schedule; stream.allow_schedules)")
    when.add_argument("--at", metavar="TIME", help="store now, deliver at TIME, RFC 3339 with its offset "
                                                  "(2026-12-01T09:30:00Z)")

    p = command("lag", "print the consumer's numbers: pending, ackPending, redelivered, delivered, ackFloor")
    p.add_argument("--stream", help="stream (default stream.name)")
    p.add_argument("--consumer", help="consumer (default consumer.name, or --pool's)")
    p.add_argument("--pool", metavar="NAME", help="the consumer of this [pools.NAME] (needed when the config has "
                                                  "several)")
    p.add_argument("--json", action="store_true", help="print JSON (one object per line with --watch)")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="repeat every SECONDS with a time column")

    p = command("status", "show a running supervisor's workers, consumer, lag, crash check and alerts")
    p.add_argument("--url", help="the supervisor's HTTP address, HOST:PORT or http://HOST:PORT "
                                 "(default monitor.http)")
    p.add_argument("--json", action="store_true", help="print the /status JSON as it is")
    p.add_argument("--fleet", action="store_true", help="every supervisor on this stream and consumer, one row "
                                                        "each, read from NATS (no HTTP to other hosts)")

    p = command("scale", "set a running supervisor's worker count")
    p.add_argument("n", type=int, metavar="N", help="the new number of workers (0 or more)")
    p.add_argument("--pool", metavar="NAME", help="the pool to scale (needed when several run)")
    p.add_argument("--url", help="the supervisor's HTTP address, HOST:PORT or http://HOST:PORT "
                                 "(default monitor.http)")

    p = command("config", "write, show or check the configuration")
    csub = p.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=ArgumentParser)
    ip = command("init", "write the commented default config", csub, "config init")
    ip.add_argument("path", nargs="?", default="config.toml", metavar="PATH",
                    help="where to write it (default ./config.toml)")
    ip.add_argument("--force", action="store_true", help="overwrite an existing file")
    command("show", "print the effective config (secrets redacted)", csub, "config show")
    command("check", "validate the config and import the handler and middleware; exit 0, 2 or 3", csub,
            "config check")

    p = command("dlq", "list or replay dead letters (jobs given up on)")
    dsub = p.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=ArgumentParser)
    lp = command("list", "list dead letters, oldest first", dsub, "dlq list")
    lp.add_argument("--json", action="store_true", help="print a JSON list")
    lp.add_argument("--limit", type=int, default=100, metavar="N", help="show at most N (default 100)")
    rp = command("replay", "publish dead letters again and remove them once stored", dsub, "dlq replay")
    which = rp.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="every dead letter there is now")
    which.add_argument("--seq", type=int, nargs="+", metavar="N", help="these dead letters (the first column "
                                                                       "of `dlq list`)")
    rp.add_argument("--subject", metavar="S", help="publish to S instead of each job's original subject")

    p = command("pause", "pause the consumer for the whole fleet (nothing is delivered until it resumes)")
    p.add_argument("--for", dest="seconds", type=float, metavar="SECONDS",
                   help="resume by itself after SECONDS (default: until `supervisor resume`)")
    p.add_argument("--reason", metavar="TEXT", help="what /status and the logs say (pause_reason)")
    p.add_argument("--pool", metavar="NAME", help="pause this [pools.NAME]'s consumer (needed with several)")
    p = command("resume", "end a pause of the consumer now")
    p.add_argument("--pool", metavar="NAME", help="resume this [pools.NAME]'s consumer (needed with several)")
    p = command("schedule", "list, add or remove recurring jobs the server fires (NATS message schedules)")
    ssub = p.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=ArgumentParser)
    lp = command("list", "list the named schedules on the stream and the delayed jobs waiting", ssub, "schedule list")
    lp.add_argument("--json", action="store_true", help="print JSON")
    ap = command("add", "add (or replace) a schedule made by hand; `start` leaves it alone", ssub, "schedule add")
    ap.add_argument("name", metavar="NAME", help="letters, digits, _ and -")
    period = ap.add_mutually_exclusive_group(required=True)
    period.add_argument("--every", type=float, metavar="SECONDS", help="fire every SECONDS (at least 1)")
    period.add_argument("--cron", metavar="EXPR", help="fire on a cron line, UTC: \"MIN HOUR DAY MONTH WEEKDAY\" "
                                                       "(6 fields: seconds first)")
    ap.add_argument("--subject", metavar="S", help="where each firing publishes a job (default: as `publish`)")
    ap.add_argument("--data", default="", metavar="TEXT", help="the job's payload (default empty)")
    ap.add_argument("--header", action="append", metavar="'NAME: VALUE'", help="a header each job carries "
                                                                              "(repeatable)")
    rp = command("rm", "remove a schedule by name", ssub, "schedule rm")
    rp.add_argument("name", metavar="NAME", help="the schedule's name (see `schedule list`)")

    p = command("demo", "watch a worker crash while holding a job, and the job come back at once")
    p.add_argument("--workers", type=int, default=3, metavar="N", help="worker processes (default 3)")
    p.add_argument("--jobs", type=int, default=30, metavar="N", help="jobs of 0.2 s to publish (default 30)")
    p.add_argument("--dashboard", nargs="?", type=float, const=float("inf"), metavar="SECONDS",
                   help="print the dashboard URL and keep the supervisor serving it after the jobs are done: "
                        "for SECONDS, or until Ctrl-C when SECONDS is left out")
    p.add_argument("--scenario", choices=("redelivery", "once"), default="redelivery",
                   help="redelivery (default): a worker crashes holding a job and the job comes back at once; "
                        "once: a worker crashes after its job's side effect, which still happens once "
                        "(workers.once, [idempotency])")
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return merge_globals(build_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        if args.command != "start":
            logs.setup("warning", args.log_format or "text")
        return COMMANDS[args.command](args)
    except SupervisorError as exc:
        print(f"supervisor: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:
        return EXIT_OK
    except Exception:
        logging.getLogger("supervisor").exception("unexpected error (a bug; please report it)")
        return EXIT_BUG


# Each command imports what it needs when it runs: a one-shot command (`publish`, `status`, ...)
# then starts without importing the whole parent (twice the CPU before it does anything).

def cmd_start(args: argparse.Namespace) -> int:
    from supervisor.parent.supervisor import Supervisor

    cfg = config.from_args(args)
    logs.setup(cfg.log.level, cfg.log.format)
    return Supervisor(cfg, reload_config=lambda: config.from_args(args),
                      file_config=lambda: config.from_args(args, with_flags=False), pins=config.flag_pins(args),
                      only=args.pool or ()).run()


def cmd_config(args: argparse.Namespace) -> int:
    if args.action == "init":
        path = Path(args.path)
        if path.exists() and not args.force:
            raise ConfigError("config init", f"{path} exists; pass --force to overwrite it")
        try:
            path.write_text(config.render(config.Config(), redact=False))
        except OSError as exc:
            raise ConfigError("config init", f"cannot write {path}: {exc.strerror or exc}") from None
        print(f"wrote {path}; set workers.handler before `supervisor start`")
        return EXIT_OK
    from supervisor.config.pools import effective
    from supervisor.config.pools import names as pool_names
    from supervisor.nats import connect as natsconn
    from supervisor.parent.supervisor import check_retry_rules, load_code

    cfg = config.from_args(args)
    if args.action == "show":
        sys.stdout.write(config.render(cfg, comments=False))
        return EXIT_OK
    natsconn.connect_kwargs(config.client_config(cfg).nats)      # secret files exist and parse
    handlers = []
    for pool in pool_names(cfg):                 # exit 2 without a handler, 3 when it does not import: as `start`
        load_code(cfg, pool)
        handlers.append(effective(cfg, pool).workers.handler + (f" (pool {pool})" if cfg.pools else ""))
    check_retry_rules(cfg)
    where = config.find_config_path(args.config, os.environ)
    print(f"config ok ({where or 'built-in defaults'}; handler {', '.join(handlers)} imports)")
    return EXIT_OK


def cmd_publish(args: argparse.Namespace) -> int:
    from supervisor.cli import publish
    return publish.cmd_publish(args)


def cmd_lag(args: argparse.Namespace) -> int:
    from supervisor.cli import lag
    return lag.cmd_lag(args)


def cmd_status(args: argparse.Namespace) -> int:
    if args.fleet:
        from supervisor.cli import fleet_status
        return fleet_status.cmd_status_fleet(args)
    from supervisor.cli import status
    return status.cmd_status(args)


def cmd_scale(args: argparse.Namespace) -> int:
    from supervisor.cli import status
    return status.cmd_scale(args)


def cmd_dlq(args: argparse.Namespace) -> int:
    from supervisor.cli import dlq
    return dlq.cmd_dlq(args)


def cmd_pause(args: argparse.Namespace) -> int:
    from supervisor.cli import pause
    return pause.cmd_pause(args)


def cmd_resume(args: argparse.Namespace) -> int:
    from supervisor.cli import pause
    return pause.cmd_resume(args)


def cmd_schedule(args: argparse.Namespace) -> int:
    from supervisor.cli import schedule
    return schedule.cmd_schedule(args)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.scenario == "once":
        from supervisor.demo import once
        return once.cmd_demo(args)
    from supervisor.demo import crash
    return crash.cmd_demo(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "start": cmd_start,
    "config": cmd_config,
    "publish": cmd_publish,
    "lag": cmd_lag,
    "status": cmd_status,
    "scale": cmd_scale,
    "dlq": cmd_dlq,
    "pause": cmd_pause,
    "resume": cmd_resume,
    "schedule": cmd_schedule,
    "demo": cmd_demo,
}
