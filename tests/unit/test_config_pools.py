"""[pools.NAME]: keys derived from [workers] and [consumer] (declared once), unset keys inherited,
each pool's effective Config, and the errors that name a pool: bad names, unknown keys, bad
values, shared consumers, overlapping filters on a work-queue stream (both pools named)."""

from __future__ import annotations

import dataclasses

import pytest

from supervisor.config import Config, ConfigError, load, render
from supervisor.config.keys import PoolConfig, WorkersConfig, section_keys
from supervisor.config.pools import DEFAULT, effective, names, select
from supervisor.config.reload import pools_plan
from supervisor.config.subjects import subjects_overlap

TOML = """
[workers]
handler = "app:default"
count = 3
job_timeout = 60.0

[consumer]
ack_wait = 20.0

[pools.email]
handler = "app.mail:send"
count = 2
filter_subject = "jobs.email.>"

[pools.reports]
filter_subject = "jobs.reports.*"
ack_wait = 300.0
consumer = "reporting"
"""


def write(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_pool_keys_are_the_workers_keys_and_the_consumer_ones_declared_once():
    keys = section_keys("pools")
    assert {f.name for f in dataclasses.fields(WorkersConfig)} < set(keys)
    assert {"filter_subject", "ack_wait", "max_deliver", "max_ack_pending", "backoff", "consumer"} < set(keys)
    assert "name" not in keys                                       # the pool's durable is `consumer`
    # the declaration's bounds and reload rule come along; the default does not (unset = inherited)
    assert keys["count"].metadata["hi"] == section_keys("workers")["count"].metadata["hi"]
    assert PoolConfig().count is None and keys["count"].metadata["inherits"] == "workers.count"


def test_each_pool_runs_on_its_effective_config(tmp_path):
    cfg = load(write(tmp_path, TOML), env={})
    assert names(cfg) == ("email", "reports")
    email, reports = effective(cfg, "email"), effective(cfg, "reports")
    assert (email.workers.handler, email.workers.count, email.workers.job_timeout) == ("app.mail:send", 2, 60.0)
    assert (email.consumer.name, email.consumer.filter_subject, email.consumer.ack_wait) == \
        ("workers-email", "jobs.email.>", 20.0)
    assert (reports.workers.handler, reports.workers.count) == ("app:default", 3)
    assert (reports.consumer.name, reports.consumer.ack_wait) == ("reporting", 300.0)
    assert reports.stream == cfg.stream and reports.retry == cfg.retry      # everything else is the config's
    # no [pools.*]: one pool, default, exactly the config
    plain = Config()
    assert names(plain) == (DEFAULT,) and effective(plain, DEFAULT) is plain
    assert select(cfg, ["reports"]) == ("reports",) and select(cfg, []) == ("email", "reports")
    with pytest.raises(ConfigError, match=r"--pool: no pool named 'mail'; the config has email, reports"):
        select(cfg, ["mail"])


def test_a_pool_renders_only_what_it_sets_and_loads_back(tmp_path):
    cfg = load(write(tmp_path, TOML), env={})
    text = render(cfg, redact=False)
    assert "[pools.reports]\nfilter_subject" in text and "job_timeout" not in text.split("[pools.email]")[1]
    assert load(write(tmp_path, text), env={}) == cfg


@pytest.mark.parametrize("pools, key, problem", [
    ('[pools."a b"]\ncount = 1\n', "[pools.a b]", "letters, digits, _ and - only"),
    ("[pools.a]\ncoutn = 1\n", "pools.a.coutn", "did you mean pools.a.count?"),
    ("[pools.a]\nname = \"x\"\n", "pools.a.name", "unknown key"),
    ("[pools.a]\ncount = -1\n", "pools.a.count", "must be at least 0"),
    ("[pools.a]\nconsumer = \"a.b\"\n", "pools.a.consumer", "not a durable consumer name"),
    ("[pools.a]\nsoft_timeout = 90.0\n", "pools.a.soft_timeout", "must be below workers.job_timeout (60)"),
    ("[pools.a]\nfilter_subject = \"mail.>\"\n", "pools.a.filter_subject", "not within stream.subjects"),
    ("[pools.a]\nfilter_subject = \"jobs.a\"\nconsumer = \"x\"\n[pools.b]\nfilter_subject = \"jobs.b\"\n"
     "consumer = \"x\"\n", "pools.b.consumer", "pools a and b would share consumer 'x'"),
    ("[pools.email]\nfilter_subject = \"jobs.email.>\"\n[pools.all]\nfilter_subject = \"jobs.*.urgent\"\n",
     "pools.all.filter_subject", "pools email and all overlap: 'jobs.email.>' and 'jobs.*.urgent' both take "
                                 "'jobs.email.urgent'"),
    ("[pools.a]\nfilter_subject = \"jobs.a\"\n[pools.b]\n", "pools.b.filter_subject",
     "pools a and b overlap: 'jobs.a' and 'jobs.>'"),
])
def test_bad_pools_name_the_pool_and_the_key(tmp_path, pools, key, problem):
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, "[workers]\njob_timeout = 60.0\n" + pools), env={})
    assert err.value.key == key and problem in str(err.value), str(err.value)


def test_overlap_is_only_an_error_on_a_work_queue_stream(tmp_path):
    text = "[stream]\nretention = \"limits\"\n[pools.a]\n[pools.b]\n"
    assert names(load(write(tmp_path, text), env={})) == ("a", "b")
    assert subjects_overlap("jobs.*.x", "jobs.a.>") and not subjects_overlap("jobs.a.>", "jobs.b.>")
    assert not subjects_overlap("jobs.a", "jobs.a.b") and subjects_overlap("jobs.>", "jobs.a.b")


def test_a_reload_plans_each_pool_on_its_effective_config():
    old = Config().replace(pools={"a": {"filter_subject": "jobs.a"}, "b": {"filter_subject": "jobs.b"}})
    new = Config().replace(workers={"count": 6, "batch": 8},
                           pools={"a": {"filter_subject": "jobs.a", "count": 2}, "b": {"filter_subject": "jobs.b",
                                  "consumer": "bee"}, "c": {"filter_subject": "jobs.c"}})
    p = pools_plan(old, new, ["a", "b"], ["a", "b", "c"])
    assert (p.added, p.removed) == (["b", "c"], ["b"])        # b moved to consumer "bee": stopped, started
    a = p.kept["a"]
    assert a.scale_to == 2 and a.replace_workers and not a.update_consumer   # batch is read at fork
    assert pools_plan(Config(), old, ["default"], ["a", "b"]).removed == ["default"]
