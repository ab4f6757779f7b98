"""Named sections ([limits.NAME], [schedules.NAME]): any number of entries of one shape, each key
checked like a fixed section's, named `section.NAME.key` in errors, rendered, and diffed by SIGHUP."""

from __future__ import annotations

import pytest

from supervisor.config import Config, ConfigError, load, render
from supervisor.config.keys import NAMED, LimitConfig, section_keys
from supervisor.config.reload import RESTART, changes, how, plan

TOML = """
[limits.db]
concurrency = 3
subjects = ["jobs.db.>"]

[limits.api]
rate = 10

[schedules.nightly]
cron = "0 3 * * *"
subject = "jobs.nightly"
"""


def write(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_entries_load_with_defaults_for_absent_keys(tmp_path):
    cfg = load(write(tmp_path, TOML), env={})
    assert cfg.limits == {"db": LimitConfig(concurrency=3, rate=0.0, subjects=("jobs.db.>",)),
                          "api": LimitConfig(concurrency=0, rate=10.0)}
    assert cfg.schedules["nightly"].cron == "0 3 * * *" and cfg.schedules["nightly"].every == 0.0
    assert Config().limits == {} and Config().schedules == {}


@pytest.mark.parametrize("text, key, problem", [
    ("[limits.db]\nconcurency = 3\n", "limits.db.concurency", "did you mean limits.db.concurrency?"),
    ("[limits.db]\nconcurrency = -1\n", "limits.db.concurrency", "must be at least 0"),
    ("[limits.db]\nrate = \"fast\"\n", "limits.db.rate", "expected a number"),
    ("[limits]\ndb = 3\n", "limits.db", "must be a table"),
    ("[limits.\"a b\"]\nrate = 1\n", "[limits.a b]", "letters, digits, _ and - only"),
    ("[limit.db]\nrate = 1\n", "[limit]", "did you mean limits?"),
])
def test_bad_entries_name_the_key(tmp_path, text, key, problem):
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, text), env={})
    assert err.value.key == key and problem in str(err.value)


def test_named_sections_are_not_set_from_the_environment(tmp_path):
    with pytest.raises(ConfigError) as err:
        load(None, env={"SUPERVISOR_LIMITS_DB_RATE": "3"})
    assert err.value.key == "SUPERVISOR_LIMITS_DB_RATE" and "config file only" in str(err.value)


def test_rendered_entries_load_back_and_init_shows_a_commented_example(tmp_path):
    cfg = load(write(tmp_path, TOML), env={})
    assert load(write(tmp_path, render(cfg, redact=False)), env={}) == cfg
    example = render(Config(), redact=False)
    assert "# [limits.NAME]" in example and "# concurrency = 0" in example
    assert load(write(tmp_path, example), env={}) == Config()          # the example stays a comment


def test_reload_names_each_changed_key_and_whole_entries():
    old = Config().replace(limits={"db": {"concurrency": 3}, "api": {"rate": 10}})
    new = Config().replace(limits={"db": {"concurrency": 5}, "mail": {"concurrency": 1}})
    assert changes_of(old, new) == {"limits.api", "limits.db.concurrency", "limits.mail"}
    p = plan(old, new)
    # Workers take limits with the config they were forked with: a change replaces them.
    assert p.effective.limits == new.limits and not p.needs_restart and p.replace_workers
    schedules = plan(Config(), Config().replace(schedules={"nightly": {"every": 60, "subject": "jobs.x"}}))
    assert not schedules.replace_workers and not schedules.needs_restart


def test_no_named_key_needs_a_restart():
    """The plan applies named sections live, entry by entry: a RESTART key there would be applied
    too early, so none may be declared (change the plan first if one must be)."""
    for section in NAMED:
        assert all(f.metadata["reload"] != RESTART for f in section_keys(section).values()), section
        assert how(f"{section}.any") != RESTART


def changes_of(old: Config, new: Config) -> set[str]:
    from supervisor.config import as_dict
    return {dotted for dotted, _, _ in changes(as_dict(old), as_dict(new))}
