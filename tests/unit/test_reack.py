"""workers/runtime/reack.py's window of recent acks, and what the parent's ledger makes of a worker's
report (pure, a fake clock). The failover itself: tests/integration/test_cluster_acks.py."""

from __future__ import annotations

from supervisor.core.ledger import CrashLedger
from workers.runtime.reack import RecentAcks


def test_the_window_keeps_acks_for_keep_seconds_oldest_first():
    w = RecentAcks(keep=30.0, limit=100)
    for seq in range(1, 6):
        w.add([(seq, f"$JS.ACK.J.w.1.{seq}.{seq}.0.0")], now=float(seq))
    assert w.sent_before(None) == [(s, f"$JS.ACK.J.w.1.{s}.{s}.0.0") for s in range(1, 6)]
    assert [s for s, _ in w.sent_before(3.0)] == [1, 2]
    assert w.prune(now=32.5) == [1, 2] and len(w) == 3          # sent at 1 and 2: older than 30 s


def test_an_ack_sent_again_moves_to_the_end_and_a_proven_one_leaves():
    w = RecentAcks(keep=30.0)
    w.add([(7, "r7")], now=0.0)
    w.add([(8, "r8")], now=1.0)
    w.add([(7, "r7")], now=2.0)                     # the settler sent it again (a new connection)
    assert [s for s, _ in w.sent_before(None)] == [8, 7]
    assert w.proven(8) and not w.proven(8) and [s for s, _ in w.sent_before(None)] == [7]


def test_the_window_never_holds_more_than_its_limit():
    w = RecentAcks(keep=1e9, limit=3)
    w.add([(seq, "r") for seq in range(10)], now=0.0)
    assert [s for s, _ in w.sent_before(None)] == [7, 8, 9]


def test_the_ledger_counts_resent_acks_and_explains_the_rerun_of_an_unconfirmed_one():
    ledger = CrashLedger(ack_wait=30.0, poison_after=3)
    ledger.acks_resent(5, 4, [42], "consumer leader n2 elected")
    cc = ledger.crosscheck(now=0.0)
    assert (cc["acks_resent"], cc["acks_resent_confirmed"], cc["acks_resent_unconfirmed"]) == (5, 4, 1)
    why = ledger.redelivered(31.0, 42, 2)
    assert "consumer leader change" in why and "n2" in why
    assert ledger.redelivered(31.0, 43, 2) == ""        # a job whose ack was confirmed: nothing explains it
