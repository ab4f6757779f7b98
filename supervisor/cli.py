"""The `supervisor` command line. Flags map onto config keys; defaults live only in config.py."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

from . import __version__, config, logs
from .errors import EXIT_BUG, EXIT_OK, ConfigError, SupervisorError

# flag dest -> config key it overrides
FLAG_KEYS = {"workers": "workers.count", "handler": "workers.handler", "http": "monitor.http",
             "log_format": "log.format"}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:       # usage errors exit 2, in one line
        self.print_usage(sys.stderr)
        raise ConfigError(self.prog, message)


def build_parser() -> ArgumentParser:
    common = ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="PATH", help="config file (else $SUPERVISOR_CONFIG, else ./config.toml)")
    common.add_argument("--server", metavar="URL", action="append", help="NATS server URL (repeatable; overrides nats.servers)")

    parser = ArgumentParser(prog="supervisor", parents=[common],
                            description="A process supervisor for NATS JetStream work queues.")
    parser.add_argument("--version", action="version", version=f"jetstream-supervisor {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    p = sub.add_parser("start", parents=[common], help="run the supervisor in the foreground")
    p.add_argument("--workers", type=int, metavar="N", help="worker processes (workers.count)")
    p.add_argument("--handler", metavar="MOD:FUNC", help="job handler (workers.handler)")
    p.add_argument("--http", metavar="HOST:PORT", help="status/metrics address (monitor.http); '' disables")
    p.add_argument("--log-format", choices=("text", "json"), help="log.format")

    p = sub.add_parser("publish", parents=[common], help="publish jobs and wait for every PubAck")
    p.add_argument("--subject", help="subject (default: the stream's first subject, '>' as 'new')")
    p.add_argument("--count", type=int, default=1, metavar="N")
    p.add_argument("--data", default="job-{i}", metavar="TEXT", help="payload; {i} is the job number (default job-{i})")
    p.add_argument("--msg-id", metavar="PREFIX", help="set Nats-Msg-Id: PREFIX-<i> (deduplicated by the server)")
    p.add_argument("--rate", type=float, metavar="PER_S", help="publish at most this many per second")

    p = sub.add_parser("lag", parents=[common], help="print ConsumerInfo as the seed post does")
    p.add_argument("--stream", help="stream (default stream.name)")
    p.add_argument("--consumer", help="consumer (default consumer.name)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="repeat every SECONDS with a time column")

    p = sub.add_parser("status", parents=[common], help="show a running supervisor's /status")
    p.add_argument("--url", help="supervisor HTTP address (default monitor.http)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("scale", parents=[common], help="set a running supervisor's worker count")
    p.add_argument("n", type=int, metavar="N")
    p.add_argument("--url", help="supervisor HTTP address (default monitor.http)")

    p = sub.add_parser("config", parents=[common], help="init, show or check the configuration")
    csub = p.add_subparsers(dest="action", required=True, parser_class=ArgumentParser)
    ip = csub.add_parser("init", parents=[common], help="write the commented default config")
    ip.add_argument("path", nargs="?", default="config.toml")
    ip.add_argument("--force", action="store_true", help="overwrite an existing file")
    csub.add_parser("show", parents=[common], help="print the effective config (secrets redacted)")
    csub.add_parser("check", parents=[common], help="validate; exit 0 or 2")

    p = sub.add_parser("demo", parents=[common], help="the seed post's scenario on an embedded server")
    p.add_argument("--workers", type=int, default=3, metavar="N")
    p.add_argument("--jobs", type=int, default=30, metavar="N")
    p.add_argument("--dashboard", nargs="?", type=float, const=float("inf"), metavar="SECONDS",
                   help="print the dashboard URL and keep the supervisor serving it after the jobs are done: "
                        "for SECONDS, or until Ctrl-C when SECONDS is left out")
    return parser


def load_config(args: argparse.Namespace) -> config.Config:
    flags: dict[str, Any] = {key: getattr(args, dest, None) for dest, key in FLAG_KEYS.items()}
    if args.server:
        flags["nats.servers"] = list(args.server)
    path = config.find_config_path(args.config, os.environ)
    return config.load(path, os.environ, flags)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command != "start":
            logs.setup("warning")
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


def cmd_start(args: argparse.Namespace) -> int:
    from .app import Supervisor

    cfg = load_config(args)
    logs.setup(cfg.log.level, cfg.log.format)
    return Supervisor(cfg, reload_config=lambda: load_config(args)).run()


def cmd_config(args: argparse.Namespace) -> int:
    if args.action == "init":
        path = Path(args.path)
        if path.exists() and not args.force:
            raise ConfigError("config init", f"{path} exists; pass --force to overwrite it")
        path.write_text(config.render(config.Config(), redact=False))
        print(f"wrote {path}")
        return EXIT_OK
    cfg = load_config(args)
    if args.action == "show":
        sys.stdout.write(config.render(cfg, comments=False))
    else:
        from . import natsconn
        from .tools import client_config

        natsconn.connect_kwargs(client_config(cfg).nats)      # secret files exist and parse
        where = config.find_config_path(args.config, os.environ)
        print(f"config ok ({where or 'built-in defaults'})")
    return EXIT_OK


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(f"supervisor.{module}"), name)(args)
    return run


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "start": cmd_start,
    "config": cmd_config,
    "publish": _lazy("tools", "cmd_publish"),
    "lag": _lazy("tools", "cmd_lag"),
    "status": _lazy("tools", "cmd_status"),
    "scale": _lazy("tools", "cmd_scale"),
    "demo": _lazy("demo", "cmd_demo"),
}
