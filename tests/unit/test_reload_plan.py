"""Unit tests for supervisor/config/reload.py: each key's declared reload behaviour drives plan()."""

from __future__ import annotations

import pytest

from supervisor import config
from supervisor.config import LIVE, REPLACE, RESTART, Config, reload

ALL_KEYS = [f"{s}.{k}" for s in config.SECTIONS for k in config.section_keys(s)]


def test_every_key_declares_how_a_reload_applies_it():
    assert {reload.how(k) for k in ALL_KEYS} <= {LIVE, REPLACE, RESTART}


def test_unchanged_config_plans_nothing():
    p = reload.plan(Config(), Config())
    assert (p.changed, p.needs_restart, p.scale_to, p.update_consumer, p.replace_workers) == ([], [], None, False, False)
    assert p.effective == Config()


def test_worker_count_is_a_scale_without_new_workers():
    p = reload.plan(Config(), Config().replace(workers={"count": 7}))
    assert p.scale_to == 7 and not p.replace_workers and not p.needs_restart
    assert p.effective.workers.count == 7


def test_consumer_settings_are_pushed_live():
    p = reload.plan(Config(), Config().replace(consumer={"ack_wait": 12.0, "max_ack_pending": 5}))
    assert p.update_consumer and not p.replace_workers
    assert p.effective.consumer.ack_wait == 12.0


@pytest.mark.parametrize("section,values", [
    ("workers", {"handler": "other.mod:fn"}), ("workers", {"concurrency": 3}), ("workers", {"batch": 64}),
    ("workers", {"graceful_timeout": 3.0}), ("workers", {"retry_backoff": [2.0]}),
    ("idempotency", {"enabled": True}),
])
def test_keys_read_at_fork_replace_the_workers(section, values):
    p = reload.plan(Config(), Config().replace(**{section: values}))
    assert p.replace_workers and not p.needs_restart


@pytest.mark.parametrize("section,values", [
    ("nats", {"servers": ["nats://elsewhere:4222"]}), ("embedded", {"port": 4333}), ("stream", {"name": "OTHER"}),
    ("monitor", {"http": "127.0.0.1:9999"}), ("log", {"format": "json"}), ("consumer", {"name": "others"}),
])
def test_restart_only_keys_keep_their_running_value(section, values):
    old = Config()
    p = reload.plan(old, old.replace(**{section: values}))
    (name, _), = values.items()
    assert p.needs_restart == [f"{section}.{name}"]
    assert getattr(getattr(p.effective, section), name) == getattr(getattr(old, section), name)
    assert not p.replace_workers and not p.update_consumer


def test_a_mixed_reload_sorts_every_change():
    new = Config().replace(workers={"count": 2, "batch": 8}, stream={"replicas": 3}, monitor={"interval": 0.5})
    p = reload.plan(Config(), new)
    assert sorted(k for k, _, _ in p.changed) == ["monitor.interval", "stream.replicas", "workers.batch",
                                                  "workers.count"]
    assert p.needs_restart == ["stream.replicas"] and p.scale_to == 2 and p.replace_workers
    assert p.effective.stream.replicas == 1 and p.effective.monitor.interval == 0.5
