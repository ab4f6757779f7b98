"""[ordering] without a server: a job's key, the stream filters that hold a key's jobs, the start
rule, the config's checks, and the worker's parking (workers/runtime/ordering.py) driven by a
fake stream. The real thing, against real servers and workers: tests/integration/test_ordering.py."""

from __future__ import annotations

import asyncio
import itertools
import random
import re
from types import SimpleNamespace

import pytest

from supervisor.config import Config, ConfigError
from supervisor.config.loading import env_overrides, load
from supervisor.config.ordering import GONE, START, WAIT, filters_of, key_filters, key_of, problems, token_of, verdict
from supervisor.config.pools import effective
from supervisor.config.reload import plan, pools_plan
from supervisor.config.subjects import subject_matches
from workers import Job
from workers.protocol import slots
from workers.protocol.modes import SERVING, STOPPING
from workers.runtime.ordering import GONE_CHECKS, Ordering, note_subject

# ---------------------------------------------------------------- keys and filters


def test_the_key_is_a_token_of_the_subject():
    assert token_of("") is None and token_of("subject:2") == 2 and token_of(" subject:1 ") == 1
    for bad in ("subject:0", "subject:x", "token:2", "subject:", "subject:65", "2"):
        with pytest.raises(ValueError, match='subject:N'):
            token_of(bad)
    assert key_of("jobs.acme.invoice", 2) == "acme" and key_of("jobs.acme", 3) is None


def test_a_keys_filters_match_exactly_its_jobs_among_the_patterns():
    """For each pattern and token, every subject the pattern matches is matched by one of the key's
    filters exactly when its token is the key (random subjects from a small alphabet)."""
    rng = random.Random(27)
    tokens = ["a", "b", "k1", "k2"]
    for pattern, n in itertools.product(["jobs.>", "jobs.*", "jobs.*.x.>", "jobs.k1.*", ">", "*.*", "jobs.*.*"],
                                        [1, 2, 3]):
        for _ in range(300):
            subject = ".".join(["jobs", *rng.choices(tokens, k=rng.randint(0, 4))])
            for key in ("k1", "k2"):
                wanted = subject_matches(pattern, subject) and key_of(subject, n) == key
                got = any(subject_matches(f, subject) for f in filters_of(pattern, n, key))
                assert got == wanted, (pattern, n, key, subject, filters_of(pattern, n, key))


def test_a_wildcard_tail_at_the_key_needs_two_filters_a_fixed_depth_one():
    assert filters_of("jobs.>", 2, "K") == ["jobs.K", "jobs.K.>"]
    assert filters_of("jobs.>", 3, "K") == ["jobs.*.K", "jobs.*.K.>"]
    assert filters_of("jobs.*", 2, "K") == ["jobs.K"]
    assert filters_of("jobs.*.x.>", 2, "K") == ["jobs.K.x.>"]
    assert filters_of("jobs.eu.*", 2, "us") == [] and filters_of("jobs.eu.*", 2, "eu") == ["jobs.eu.*"]
    assert key_filters(["jobs.>", "orders.*"], 2, "K") == ("jobs.K", "jobs.K.>", "orders.K")


def test_a_pattern_that_cannot_have_the_token_is_a_problem():
    assert problems("subject:2", ["jobs.>"]) == [] and problems("", ["a"]) == []
    assert problems("subject:3", ["jobs.*", "jobs.>"]) == [
        "token 3 of 'jobs.*': a subject it matches has 2 token(s), so its jobs would have no key"]
    assert problems("bad", ["jobs.>"])[0].startswith('expected "subject:N"')


def test_a_job_starts_only_when_it_is_the_first_stored_of_its_key():
    assert verdict(5, 5) == START
    assert verdict(5, 3) == WAIT                 # an earlier job of the key is not done
    assert verdict(5, None) == GONE and verdict(5, 7) == GONE   # it is no longer stored itself


# ---------------------------------------------------------------- the config


def test_the_config_names_what_is_wrong_with_ordering(tmp_path):
    assert Config().replace(ordering={"key": "subject:2"}).ordering.key == "subject:2"
    for values, problem in (({"ordering": {"key": "subject:two"}}, 'expected "subject:N"'),
                            ({"ordering": {"key": "subject:3"}, "stream": {"subjects": ["jobs.*"]}}, "no key"),
                            ({"ordering": {"key": "subject:2"}, "stream": {"retention": "limits"}}, "workqueue")):
        with pytest.raises(ConfigError, match=problem) as caught:
            Config().replace(**values)
        assert caught.value.exit_code == 2 and "ordering.key" in str(caught.value)


def test_partitions_is_no_longer_a_key_and_says_why(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[ordering]\nkey = "subject:2"\npartitions = 16\n')
    with pytest.raises(ConfigError, match="ordering.partitions: no longer a key: .*no partitions"):
        load(path, env={})
    with pytest.raises(ConfigError, match="no longer a key"):
        env_overrides({"SUPERVISOR_ORDERING_PARTITIONS": "16"})


def test_with_ordering_a_new_max_ack_pending_or_filter_replaces_the_workers():
    base = Config().replace(ordering={"key": "subject:2"})
    assert plan(base, base.replace(consumer={"max_ack_pending": 50})).replace_workers
    assert plan(base, base.replace(consumer={"filter_subject": "jobs.a.>"})).replace_workers
    assert not plan(base, base.replace(consumer={"ack_wait": 9.0})).replace_workers
    assert not plan(Config(), Config().replace(consumer={"max_ack_pending": 50})).replace_workers


def test_with_pools_ordering_is_each_pools_own_on_its_filter():
    """[ordering] reaches every pool that does not set `ordering_key`; `ordering_key = ""` turns
    it off in one pool; each ordered pool is checked on its own filter, the error naming the key
    the pool sets, or the pool and the inherited key; a pool's change of it replaces its workers."""
    pools = {"a": {"filter_subject": "jobs.a.>"}, "b": {"filter_subject": "jobs.b", "ordering_key": ""},
             "c": {"filter_subject": "jobs.c.*", "ordering_key": "subject:2"}}
    cfg = Config().replace(ordering={"key": "subject:3"}, pools=pools)
    assert [effective(cfg, n).ordering.key for n in ("a", "b", "c")] == ["subject:3", "", "subject:2"]
    assert effective(cfg, "b").workers == cfg.workers and effective(cfg, "c").consumer.filter_subject == "jobs.c.*"
    assert effective(Config().replace(pools=pools), "c").ordering.key == "subject:2"     # no [ordering]: its own
    for values, key, problem in (
            ({"b": {"filter_subject": "jobs.b", "ordering_key": "subject:3"}}, "pools.b.ordering_key", "no key"),
            ({"b": {"filter_subject": "jobs.b"}}, "pools.b", "ordering.key (not set in the pool, so [ordering]'s)"),
            ({"b": {"filter_subject": "jobs.b", "ordering_key": "subject:x"}}, "pools.b.ordering_key", "subject:N")):
        with pytest.raises(ConfigError, match=re.escape(problem)) as caught:
            Config().replace(ordering={"key": "subject:3"}, pools={**pools, **values})
        assert caught.value.key == key and caught.value.exit_code == 2, str(caught.value)
    with pytest.raises(ConfigError, match='expected "subject:N"'):      # [ordering] itself, though no pool uses it
        Config().replace(ordering={"key": "first"}, pools={"b": {"ordering_key": ""}})
    p = pools_plan(cfg, cfg.replace(pools={**pools, "a": {"filter_subject": "jobs.a.>", "ordering_key": "subject:2"}}),
                   ["a", "b", "c"], ["a", "b", "c"])
    assert p.kept["a"].replace_workers and not p.kept["b"].replace_workers and not p.kept["c"].replace_workers
    assert ("ordering.key", "subject:3", "subject:2") in p.kept["a"].changed


def test_a_work_queue_that_drops_jobs_or_denies_deletes_is_refused_by_the_rule_it_breaks():
    """The per-subject limit is refused unless it refuses new jobs instead of dropping stored ones
    (discard "new" alone still drops: nats-server stores, then enforces); deny_delete only where
    the consumer gives up on a job (max_deliver > 0), for the parent's delete of it."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StreamConfig

    from supervisor.nats.provision import removes_jobs_itself

    cfg = Config().replace(ordering={"key": "subject:2"})

    def stream(**settings):
        return StreamConfig(name="JOBS", subjects=["jobs.>"], retention=RetentionPolicy.WORK_QUEUE, **settings)
    assert removes_jobs_itself(cfg, stream(), 10) == ""
    assert removes_jobs_itself(cfg, stream(max_msgs_per_subject=-1), 10) == ""
    for discard in (DiscardPolicy.OLD, DiscardPolicy.NEW):
        said = removes_jobs_itself(cfg, stream(max_msgs_per_subject=3, discard=discard), 10)
        assert "stream JOBS keeps 3 job(s) per subject" in said and "consumer workers" in said, said
    assert removes_jobs_itself(cfg, stream(max_msgs_per_subject=3, discard=DiscardPolicy.NEW,
                                           discard_new_per_subject=True), 10) == ""
    said = removes_jobs_itself(cfg, stream(deny_delete=True), 10)
    assert "denies deletes" in said and "after 10 deliveries" in said, said
    assert removes_jobs_itself(cfg, stream(deny_delete=True), -1) == ""


# ---------------------------------------------------------------- a worker's parking, on a fake stream


class Stream:
    """The stored jobs (seq -> subject) and the first one on a filter, as STREAM.MSG.GET says."""

    def __init__(self, subjects: list[str]):
        self.stored = dict(enumerate(subjects, start=1))
        self.asked = 0
        self.down = False

    async def ask(self, subject_filter: str, from_seq: int) -> int | None:
        self.asked += 1
        await asyncio.sleep(0)
        if self.down:
            raise TimeoutError("no answer")
        return min((s for s, subj in self.stored.items() if s >= from_seq and subject_matches(subject_filter, subj)),
                   default=None)


class Host:
    """The worker around [ordering]: what it does with a job whose turn came, or that it gives back."""

    def __init__(self, stream: Stream, cfg: Config | None = None):
        self.stream = stream
        self.mode = SERVING
        self.table = slots.SlotTable(16, 64, key_bytes=slots.KEY_BYTES)
        self.wake_pull = asyncio.Event()
        self.started: list[int] = []
        self.given_back: list[int] = []
        self.notes: list[tuple[str, bytes]] = []
        self.pulls = SimpleNamespace(not_started=lambda: None)
        self.acked_unrun: list[tuple[int, int]] = []       # (seq, delivery)
        self.settler = SimpleNamespace(settle=self.settle, ack=self.ack_unrun)
        cfg = cfg or Config().replace(ordering={"key": "subject:2"})
        self.ordering = Ordering(cfg, 0, self)
        self.ordering.ask, self.ordering.publish = stream.ask, self.publish

    def cleared(self, item) -> None:
        self.started.append(item[2].stream_seq)

    async def settle(self, i: int, job: Job, payload: bytes, outcome: str, reason: str) -> None:
        assert payload == b"-NAK" and outcome == "nak"
        self.given_back.append(job.stream_seq)

    async def ack_unrun(self, i: int, job: Job, outcome: str) -> None:
        assert outcome == "duplicate"
        self.acked_unrun.append((job.stream_seq, job.delivery))

    async def publish(self, subject: str, payload: bytes) -> None:
        """A note: it comes back to the worker that sent it, as NATS echoes it."""
        self.notes.append((subject, payload))
        self.ordering.note(subject.rpartition(".")[2], int(payload))

    def admit(self, seq: int, delivery: int = 1) -> tuple[int, Job]:
        job = Job(data=b"", subject=self.stream.stored.get(seq, "jobs.gone"), headers={}, stream_seq=seq,
                  delivery=delivery)
        i = self.table.hold(seq, seq, delivery, b"$JS.ACK.JOBS.workers.%d.%d.%d.0.0" % (delivery, seq, seq))
        assert self.ordering.admit((None, i, job))
        return i, job

    def ack(self, i: int, job: Job) -> None:
        """The job ran and was acked: it leaves the stream, the worker says so."""
        del self.stream.stored[job.stream_seq]
        self.ordering.settled(i, job, "ack")


async def until(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def test_a_job_waits_for_the_earlier_jobs_of_its_key_wherever_they_run_and_others_go_past():
    async def run() -> None:
        stream = Stream(["jobs.K.x", "jobs.K", "jobs.J", "jobs.K"])      # 1, 2 (held by another worker), 3, 4
        host = Host(stream)
        i1, j1 = host.admit(1)
        i4, _ = host.admit(4)
        host.admit(3)
        await until(lambda: host.started == [1, 3], "seq 1 and the other key's 3 started")
        assert host.ordering.occupying() == 0 and host.ordering.parked() == 1
        host.ack(i1, j1)                                    # seq 1 done: the first of K is 2 now (elsewhere)
        await until(lambda: any(e.waiting_for == 2 for e in host.table.snapshot()), "seq 4 told to wait for 2")
        assert host.started == [1, 3] and host.notes == [(note_subject("JOBS", "workers", "K"), b"1")]
        assert [e.key for e in host.table.snapshot() if e.index == i4] == ["K"]
        del stream.stored[2]
        host.ordering.note("K", 2)                           # the worker that ran 2 says so
        await until(lambda: host.started == [1, 3, 4], "seq 4 started")
        assert host.table.header(slots.ORDER_PARKED) == 0
    asyncio.run(run())


def test_a_job_the_stream_no_longer_stores_is_given_back_never_started():
    async def run() -> None:
        stream = Stream(["jobs.K"])
        host = Host(stream)
        del stream.stored[1]                                 # acked elsewhere: this delivery came twice
        host.admit(1)
        await until(lambda: host.given_back == [1], "the duplicate given back")
        assert host.started == [] and stream.asked >= GONE_CHECKS * 2
    asyncio.run(run())


def test_without_an_answer_nothing_starts():
    async def run() -> None:
        stream = Stream(["jobs.K"])
        stream.down = True
        host = Host(stream)
        host.admit(1)
        await until(lambda: stream.asked >= 4, "asked again")
        assert host.started == [] and host.ordering.occupying() == 1
        stream.down = False
        host.ordering.note("K", 0)
        await until(lambda: host.started == [1], "started once the stream answers")
    asyncio.run(run())


def test_a_drain_takes_the_parked_jobs_back_in_stream_order():
    async def run() -> None:
        stream = Stream(["jobs.K"] * 4)
        host = Host(stream)
        host.admit(1)
        for seq in (4, 2, 3):
            host.admit(seq)
        await until(lambda: host.started == [1], "seq 1 started")
        host.mode = STOPPING
        items = host.ordering.take_parked()
        assert [job.stream_seq for _, _, job in items] == [2, 3, 4]
        assert host.ordering.parked() == 0 and host.table.header(slots.ORDER_PARKED) == 0
    asyncio.run(run())


def test_a_job_without_the_keys_token_is_not_ordered():
    host = Host(Stream(["jobs.K"]), Config().replace(ordering={"key": "subject:3"},
                                                     stream={"subjects": ["jobs.>", "x.*.*"]}))
    job = Job(data=b"", subject="jobs.K", headers={}, stream_seq=1)
    assert not host.ordering.admit((None, 0, job))


def test_a_job_stored_again_below_what_the_stream_said_is_first_still_runs():
    """A server SIGKILLed before it persisted an ack's removal stores the job again after the
    worker learnt that later jobs of its key were first: asked about from its own sequence, it
    runs (a duplicate the fault explains), never given back as gone delivery after delivery."""
    async def run() -> None:
        stream = Stream(["jobs.K", "jobs.K"])
        host = Host(stream)
        i2, j2 = host.admit(2)
        await until(lambda: any(e.waiting_for == 1 for e in host.table.snapshot()), "seq 2 waiting for 1")
        del stream.stored[1]
        host.ordering.note("K", 1)
        await until(lambda: host.started == [2], "seq 2 started")
        host.ack(i2, j2)
        # Once the key is idle here its settled sequences are forgotten (while it is busy, a
        # delivery of seq 1 would be acked unrun: the next test).
        await until(lambda: "K" not in host.ordering.keys, "the key idle")
        stream.stored[1] = "jobs.K"                      # the restarted server has it again
        host.admit(1)
        await until(lambda: host.started == [2, 1], "seq 1 ran again")
        assert host.given_back == []
    asyncio.run(run())


def test_a_second_delivery_of_a_job_settled_here_is_acked_unrun_while_the_stream_still_stores_it():
    """F15 (seed 604, seq 771): two deliveries of one job parked in one worker. The first ran and
    was acked; the server has read the ack and not applied it yet, so the stream still says the
    job is the first of its key. The second must not start: it is acked unrun, never asked about."""
    async def run() -> None:
        stream = Stream(["jobs.K", "jobs.K"])
        host = Host(stream)
        i1, j1 = host.admit(1)
        host.admit(1, delivery=2)
        host.admit(2)
        await until(lambda: host.started == [1], "delivery 1 of seq 1 started")
        host.ordering.settled(i1, j1, "ack")              # acked; the stream still stores seq 1
        await until(lambda: host.acked_unrun == [(1, 2)], "delivery 2 acked unrun")
        assert host.started == [1] and host.given_back == []
        del stream.stored[1]                              # the removal applied
        await until(lambda: host.started == [1, 2], "seq 2 started")
    asyncio.run(run())


def test_a_job_a_note_said_settled_is_acked_unrun_when_its_redelivery_is_parked_here():
    """Another worker said it settled seq 1 (a note): a delivery of seq 1 parked here, behind the
    key's earlier job or not, is acked unrun, whatever the stream still stores."""
    async def run() -> None:
        stream = Stream(["jobs.K", "jobs.K"])
        host = Host(stream)
        host.admit(2)
        await until(lambda: host.ordering.occupying() == 0, "seq 2 waiting for 1")
        host.ordering.note("K", 1)
        host.admit(1, delivery=2)
        await until(lambda: host.acked_unrun == [(1, 2)], "seq 1 acked unrun")
        assert host.started == []
    asyncio.run(run())
