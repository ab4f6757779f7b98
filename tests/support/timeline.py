"""How a test run spent its time, from the lines tests/conftest.py appends to $JSS_TEST_TIMELINE
(one per test: worker, start, end, test id). Each xdist worker's busy time and when it ran out
of work, the tail (the last worker's end after the first ran dry), and the longest tests.

    JSS_TEST_TIMELINE=/tmp/timeline.txt python -m pytest
    python tests/support/timeline.py /tmp/timeline.txt [--top N]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path


def read(path: Path) -> list[tuple[str, float, float, str]]:
    rows = []
    for line in path.read_text().splitlines():
        worker, start, end, nodeid = line.split(" ", 3)
        rows.append((worker, float(start), float(end), nodeid))
    return rows


def report(rows: list[tuple[str, float, float, str]], top: int) -> str:
    t0 = min(r[1] for r in rows)
    by_worker: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for worker, start, end, _ in rows:
        by_worker[worker].append((start - t0, end - t0))
    ends = {w: max(e for _, e in spans) for w, spans in by_worker.items()}
    out = [f"{len(rows)} tests, {len(by_worker)} worker(s), first start to last end {max(ends.values()):.1f} s"]
    for worker in sorted(by_worker, key=lambda w: (len(w), w)):
        spans = by_worker[worker]
        busy = sum(e - s for s, e in spans)
        out.append(f"  {worker:>6}: {len(spans):4d} tests, busy {busy:7.1f} s, last end {ends[worker]:7.1f} s")
    if len(ends) > 1:
        out.append(f"tail: the last worker ended {max(ends.values()) - min(ends.values()):.1f} s after the first ran dry")
    out.append(f"longest {top}:")
    for worker, start, end, nodeid in sorted(rows, key=lambda r: r[1] - r[2])[:top]:
        out.append(f"  {end - start:7.2f} s  {worker:>6} at {start - t0:7.1f} s  {nodeid}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    print(report(read(args.path), args.top))


if __name__ == "__main__":
    main()
