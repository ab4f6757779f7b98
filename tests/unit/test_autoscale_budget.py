"""[autoscale] budget: one cap on the workers of all pools together, the next worker going to the
pool where it does the most work (supervisor/core/autoscale.py `share`), with a fake clock: the
pure sharing, and two pools' policies run on tests/unit/test_autoscale_policy.py's simulator,
sharing a budget the way the arbiter's loop does (parent/arbiter.py share_budget)."""

from __future__ import annotations

import math
from dataclasses import replace

from test_autoscale_policy import MONITOR, Sim, backlog, free, params

from supervisor.core.autoscale import Claim, share


def claim(name: str, workers: int, gain: float = 0.0, busy: float = 0.0, eta: float = math.inf,
          fixed: bool = False) -> Claim:
    return Claim(name, workers, 1, gain, busy, eta, fixed)


def caps(budget: int, *claims: Claim) -> dict[str, int]:
    return {name: n for name, (n, _) in share(budget, list(claims)).items()}


def test_a_worker_goes_where_it_does_the_most_work():
    # A's backlog would take a new worker's whole time; B's 3 workers are idle: B keeps its floor
    assert caps(4, claim("a", 1, gain=1.0), claim("b", 3, busy=0.0)) == {"a": 3, "b": 1}
    # both busy: nobody's worker is taken for an equal one (no churn), A waits for B's backlog
    assert caps(4, claim("a", 1, gain=1.0), claim("b", 3, busy=3.0)) == {"a": 1, "b": 3}
    # B's workers do 1.5 workers' worth: its third is idle and half of its second: A gets both
    assert caps(4, claim("a", 1, gain=1.0), claim("b", 3, busy=1.5)) == {"a": 3, "b": 1}
    # 2.5: only the third is worth less than a new worker of A's
    assert caps(4, claim("a", 1, gain=1.0), claim("b", 3, busy=2.5)) == {"a": 2, "b": 2}
    # a step that did not pay (a downstream plateau: gain 0) gets nothing
    assert caps(4, claim("a", 1, gain=0.0), claim("b", 1, gain=1.0)) == {"a": 1, "b": 3}
    # equal work: the backlog that takes longer to drain first, whatever its jobs' size
    assert caps(3, claim("fast", 1, gain=1.0, eta=20.0), claim("slow", 1, gain=1.0, eta=600.0)) == \
        {"fast": 1, "slow": 2}
    # nobody wants more: every worker stays, the rest of the budget is left unspent ...
    assert caps(9, claim("a", 2, eta=0.0), claim("b", 3, eta=0.0)) == {"a": 2, "b": 3}
    # ... unless a backlog waits whose pool has not asked yet: it may take the rest if its policy wants it
    assert caps(9, claim("a", 2, eta=13.0), claim("b", 3, eta=0.0)) == {"a": 6, "b": 3}
    # a count set by hand is taken from the budget as it is
    assert caps(5, claim("a", 4, fixed=True), claim("b", 1, gain=1.0)) == {"a": 4, "b": 1}
    (n, why), = share(2, [claim("a", 2, gain=1.0)]).values()
    assert n == 2 and why.startswith("autoscale.budget = 2 is shared: a 2")


def test_two_pools_under_a_budget_shift_workers_to_the_backlog_and_back():
    """Budget 5, min 1, max 4 each: a backlog in pool a takes workers up to 4 while b gets one;
    b's backlog, come meanwhile, waits for a's to drain, then the workers go to b; then back to a."""
    budget = 5
    a = Sim(free(), lambda t, dt: backlog(2400)(t, dt) + backlog(2400, at=100.0)(t, dt), params(hi=4))
    b = Sim(free(), backlog(2400, at=30.0), params(hi=4))
    sims = {"a": a, "b": b}
    peak = 0
    next_poll, next_decision, until = 0.0, a.params.interval, 175.0
    while a.t < until:
        for sim in sims.values():
            sim.step()
        if a.t >= next_poll:
            for sim in sims.values():
                sim.poll()
            next_poll += MONITOR
        if a.t >= next_decision - 1e-9:
            shares = share(budget, [sim.policy.claim(name, sim.target, 1) for name, sim in sims.items()])
            for name, sim in sims.items():
                d = sim.policy.decide(replace(sim.inputs(), cap=shares[name][0], capped=shares[name][1]))
                sim.decisions.append((sim.t, d))
                if d.target != sim.target:
                    sim.scale(d.target)
            peak = max(peak, a.target + b.target)
            next_decision += a.params.interval
    assert peak <= budget, f"the pools together went over the budget: {a.timeline()} / {b.timeline()}"
    at = lambda sim, t: [n for s, n in sim.history if s <= t][-1]      # noqa: E731
    assert at(a, 55) == 4 and at(b, 55) == 1, f"{a.timeline()} / {b.timeline()}"
    assert at(b, 95) == 4 and at(a, 95) == 1, f"{a.timeline()} / {b.timeline()}"
    assert at(a, 170) == 4 and at(b, 170) == 1, f"{a.timeline()} / {b.timeline()}"
    assert "budget" in b.kinds() and "budget" in a.kinds()
