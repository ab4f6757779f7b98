"""`supervisor status` and `supervisor scale`: a running supervisor, over its HTTP endpoint."""

from __future__ import annotations

import argparse
import json
import sys
from urllib.parse import quote

from supervisor.cli.client import SupervisorUnreachable, http_call, http_reason, supervisor_url, target_now
from supervisor.cli.oneshot import one_line
from supervisor.cli.render import render_status, use_color
from supervisor.errors import EXIT_OK, ConfigError


def cmd_status(args: argparse.Namespace) -> int:
    """`supervisor status [--url URL] [--json]`: a running supervisor's /status, for people or scripts.

    Exit 0 when the supervisor answered; 1 when nothing (or no supervisor) answers at the URL,
    in one line; 2 when the URL itself is malformed. (`--fleet` is supervisor/parent/tasks/fleet.py's.)"""
    base = supervisor_url(args)
    code, body = http_call(base, "GET", "/status")
    if code != 200:
        raise SupervisorUnreachable(f"GET {base}/status answered {code} {http_reason(code)}: {one_line(body)}")
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    if not isinstance(status, dict) or "workers" not in status:
        raise SupervisorUnreachable(f"{base}/status did not answer with a supervisor's /status JSON: {one_line(body)}")
    if args.json:
        sys.stdout.write(body if body.endswith("\n") else body + "\n")
    else:
        print(render_status(status, color=use_color(sys.stdout)))
    return EXIT_OK


def cmd_scale(args: argparse.Namespace) -> int:
    """`supervisor scale N [--pool NAME] [--url URL]`: POST /scale?workers=N[&pool=NAME] and print
    the new target.

    Exit 0 when the supervisor took the new target; 2 for N < 0, a malformed URL, or a target
    the supervisor refuses (4xx: several pools and no --pool, a pool it does not run, a halted
    one); 1 when nothing answers at the URL or it answers 5xx."""
    if args.n < 0:
        raise ConfigError("N", f"the worker count must be 0 or more, got {args.n}")
    base = supervisor_url(args)
    pool = getattr(args, "pool", None)
    before = target_now(base, pool)
    path = f"/scale?workers={args.n}" + (f"&pool={quote(pool)}" if pool else "")
    code, body = http_call(base, "POST", path)
    if code >= 400:
        answer = f"POST {base}{path} answered {code} {http_reason(code)}: {one_line(body)}"
        if code < 500:
            raise ConfigError("scale", answer)
        raise SupervisorUnreachable(answer)
    try:
        target = int(json.loads(body)["target"])
    except (ValueError, KeyError, TypeError):
        target = args.n
    was = f" (was {before})" if before is not None else ""
    print(f"target {target} worker{'s' if target != 1 else ''}{f' in pool {pool}' if pool else ''}{was}; "
          "`supervisor status` shows them "
          f"{'starting' if before is None or target >= before else 'draining'}")
    return EXIT_OK
