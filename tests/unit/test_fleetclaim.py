"""workers/protocol/fleetclaim.py: an orphan's claim on its dead parent's fleet heartbeat, and the
poller's lost mark it reads (seed 52: a release, then the orphan's NAK hit the next delivery)."""

from __future__ import annotations

from workers.protocol.fleetclaim import claimed, orphan_key, released

REPLY = "$JS.ACK.JOBS.workers.1.{}.{}.1796162710029000000.0"


def beat(**extra) -> dict:
    held = [[s, d, age, REPLY.format(s, s), "running"] for s, d, age in ((5, 1, 3.0), (6, 2, 1.0), (7, 1, 0.5))]
    return {"name": "alpha", "pid": 10, "t": 100.0, "held": held, "held_total": 4, **extra}


def test_a_claim_takes_out_the_orphans_jobs_and_brings_the_rest_up_to_now():
    out = claimed(beat(), {(5, 1), (7, 2)}, 102.5, "vm/11/ab (worker 0, orphan of pid 10)")
    assert [(s, d, age) for s, d, age, *_ in out["held"]] == [(6, 2, 3.5), (7, 1, 3.0)]   # (7, 2): another delivery
    assert out["held_total"] == 3 and out["t"] == 102.5
    assert out["orphans"] == ["vm/11/ab (worker 0, orphan of pid 10)"]
    again = claimed(out, {(6, 2)}, 102.5, "vm/12/cd (worker 1, orphan of pid 10)")
    assert [h[0] for h in again["held"]] == [7] and again["held_total"] == 2 and len(again["orphans"]) == 2
    assert "lost" not in again


def test_the_poller_mark_says_what_it_released_or_else_everything_listed():
    assert released(beat(), "workers") is None                                          # no mark: claim it
    assert released(beat(lost={"by": "beta", "released": [[6, 2]]}), "workers") == {(6, 2)}
    assert released(beat(lost={"by": "beta", "released": []}), "workers") == set()     # release_lost off: nothing
    assert released(beat(lost={"by": "beta"}), "workers") == {(5, 1), (6, 2), (7, 1)}   # an older poller's mark


def test_with_pools_the_mark_speaks_for_the_consumers_whose_pollers_acted():
    mark = {"by": "beta", "consumers": ["emails"], "released": {"emails": [[6, 2]]}}
    assert released(beat(lost=mark), "emails") == {(6, 2)}
    assert released(beat(lost=mark), "workers") is None     # its own poller has not acted: claim
    both = {**mark, "consumers": ["emails", "workers"], "released": {"emails": [[6, 2]], "workers": []}}
    assert released(beat(lost=both), "workers") == set()


def test_an_orphans_record_sits_beside_the_heartbeats_under_its_parents_name():
    assert orphan_key("sup.vm.4321.a1b2c3", "deadbeef") == "orphan.vm.4321.a1b2c3.deadbeef"
