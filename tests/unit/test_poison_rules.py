"""Issue 22, R7, the rules without a server: which deaths are poison evidence against which job
(supervisor/core/ledger.py), and how a worker lets a suspect run alone (workers/runtime/solo.py)."""

import asyncio

from supervisor.core.ledger import CrashLedger
from workers.runtime.solo import AsyncGate, Gate, SuspectBoard


def test_a_death_beside_others_puts_them_on_probation_and_blames_none():
    led = CrashLedger(ack_wait=30.0, poison_after=1)
    led.record_death(1.0, 0, 1, "SIGKILL", [(5, 1, "running", True), (6, 1, "running", True), (7, 1, "held", True)])
    assert not led.is_poison(5) and not led.is_poison(6)
    assert sorted(led.on_probation()) == [5, 6]
    led.record_death(2.0, 0, 2, "SIGKILL", [(5, 2, "running", True), (6, 2, "held", True)])   # 5 ran alone
    assert led.is_poison(5) and not led.is_poison(6)
    led.settled(3.0, 6, 3, "ack")                    # 6 ran to an outcome: off probation
    assert led.on_probation() == []


def test_a_job_timeout_kill_blames_the_job_it_names_whatever_ran_beside_it():
    led = CrashLedger(ack_wait=30.0, poison_after=1)
    led.record_death(1.0, 0, 1, "killed: job seq=6 ran 31s", [(5, 1, "running", True), (6, 1, "running", True)],
                     blame=6)
    assert led.is_poison(6) and not led.is_poison(5) and led.on_probation() == []


def test_the_supervisors_own_kills_are_no_evidence_at_all():
    led = CrashLedger(ack_wait=30.0, poison_after=1)
    led.record_death(1.0, 0, 1, "SIGQUIT", [(5, 1, "running", True), (6, 1, "running", True)], job_to_blame=False)
    assert led.on_probation() == [] and not led.is_poison(5)


def test_a_suspect_waits_for_the_running_and_nothing_starts_beside_it():
    board = SuspectBoard(capacity=4)
    board.show([9])
    gate = Gate(board)
    assert gate.try_start(1) and gate.try_start(2)          # ordinary jobs run side by side
    assert not gate.try_start(9)                            # the suspect claims the worker, waits
    assert not gate.try_start(3)                            # nothing new starts meanwhile
    assert not gate.finished(1) and gate.finished(2)        # the last one out lets it go
    assert gate.try_start(9) and not gate.try_start(3)      # alone
    assert gate.finished(9) and gate.try_start(3)
    board.show([])
    assert not board.suspect(9) and gate.try_start(9)


def test_the_board_keeps_the_lowest_when_more_suspects_than_it_holds():
    board = SuspectBoard(capacity=2)
    board.show([30, 10, 20])
    assert board.suspect(10) and board.suspect(20) and not board.suspect(30)


def test_a_suspect_waiting_for_its_turn_is_given_back_when_the_stop_comes_with_it():
    """An async worker: a suspect waits for the job running beside it; the stop (SIGTERM) and
    that job's end come in one tick. The suspect was pulled before the stop: it must be given
    back unstarted (run_async NAKs it), not start after the stop began."""
    async def main() -> None:
        board = SuspectBoard()
        board.show([9])
        gate, stopping = AsyncGate(board), [False]
        assert gate.try_start(1)                    # an ordinary job runs
        waiter = asyncio.ensure_future(gate.start(9, lambda: stopping[0]))
        await asyncio.sleep(0)
        assert not waiter.done()                    # the suspect waits for it
        stopping[0] = True
        gate.wake()                                 # Worker.set_mode(STOPPING) ...
        gate.done(1)                                # ... and the running job's end, before the waiter looks
        assert await waiter is False
        assert gate.solo is None and gate.try_start(2)   # nothing claims the worker any more
    asyncio.run(main())
