"""The verdict table (Markdown), one row per run, as docs/RELIABILITY.md shows it."""

from __future__ import annotations

from typing import Any

COLUMNS = [("jobs", "jobs"), ("lost", "lost"), ("vanished", "vanished (server)"), ("dead_lettered", "dead-lettered"),
           ("deduplicated", "deduplicated (guard)"),
           ("dup", "done twice"), ("dup_unexplained", "of which unexplained"),
           ("redelivered", "redelivered"), ("bounced", "bounced"), ("unexplained", "unexplained redeliveries"),
           ("ackwait", "AckWait waits"),
           ("ackwait_outside", "AckWait waits (fault outside control)"), ("unacked", "unacked"),
           ("sup_unexplained", "supervisor: unexplained"), ("sup_open", "supervisor: open"),
           ("sup_died", "supervisor died"), ("healthz_s", "/healthz back (s)")]


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def render(results: list, meta: dict[str, Any]) -> str:
    head = ["scenario", *(title for _, title in COLUMNS), "verdict"]
    lines = [f"Measured on commit {meta.get('commit', '?')} ({meta.get('branch', '?')})"
             + (" with uncommitted changes" if meta.get("uncommitted") else "")
             + f", `{meta.get('command', '')}`, {meta.get('seconds', '?')} s.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.name} | " + " | ".join("-" for _ in COLUMNS) + f" | skipped: {r.skipped} |")
            continue
        verdict = "PASS" if r.passed else "FAIL: " + "; ".join(r.failures + ([r.error] if r.error else []))
        lines.append(f"| {r.name} | " + " | ".join(cell(r.counts.get(k)) for k, _ in COLUMNS) + f" | {verdict} |")
    return "\n".join(lines) + "\n"
