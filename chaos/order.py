"""Per-key order, read from a handlers' journal ([ordering]: README "Ordered per key").

The rule the journal must show: for jobs a < b of one key (stream sequences), every run of b
starts after every run of a has ended (its done line, or the death of its worker). A rerun of a
after b started is a reorder as much as b starting early. Pure: the integration tests and the
randomized suite's checker (chaos/checker.py) both judge by it; which faults may explain a
reorder is theirs to say.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    seq: int
    pid: int
    delivery: int
    start: float
    end: float | None          # its done (or retried) line; None: it never ended in the journal


@dataclass(frozen=True)
class Reorder:
    key: str
    before: Run                # the earlier job's run that ended too late ...
    after: Run                 # ... for this run of a later job of the key
    ended: float               # when `before` ended (its worker's death if it has no end)

    def describe(self) -> str:
        return (f"key {self.key}: seq {self.after.seq} (delivery {self.after.delivery}, pid {self.after.pid}) started "
                f"{self.ended - self.after.start:.3f}s before seq {self.before.seq} (delivery {self.before.delivery}, "
                f"pid {self.before.pid}) ended")


def reorders(runs: Iterable[Run], key_of: Mapping[int, str], died: Mapping[int, float] | None = None) -> list[Reorder]:
    """Every run that started before a run of an earlier job of its key had ended. A run with no
    end ended when its worker died (`died`: pid -> time), else never."""
    died = died or {}
    by_key: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        if r.seq in key_of:
            by_key[key_of[r.seq]].append(r)
    out: list[Reorder] = []
    for key, rs in by_key.items():
        rs.sort(key=lambda r: (r.seq, r.start))
        latest: Run | None = None          # the run of an earlier seq that ended last, and when
        latest_end = float("-inf")
        pending: list[tuple[Run, float]] = []
        seq = None
        for r in rs:
            if r.seq != seq:               # runs of a new seq: fold the previous seq's into `latest`
                for run, end in pending:
                    if end > latest_end:
                        latest, latest_end = run, end
                pending, seq = [], r.seq
            if latest is not None and r.start < latest_end:
                out.append(Reorder(key, latest, r, latest_end))
            end = r.end if r.end is not None else died.get(r.pid, float("inf"))
            pending.append((r, end))
    return out


def overlap(runs: Iterable[Run]) -> float:
    """Handler time summed over the span from the first start to the last end: how many jobs ran
    at once on average (1.0: one at a time)."""
    done = [r for r in runs if r.end is not None]
    if not done:
        return 0.0
    span = max(r.end for r in done if r.end is not None) - min(r.start for r in done)
    return sum((r.end or r.start) - r.start for r in done) / span if span > 0 else 0.0
