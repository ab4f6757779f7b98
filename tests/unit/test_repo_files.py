"""The files users copy from the repo stay true to the code."""

from pathlib import Path

from supervisor import config

REPO = Path(__file__).resolve().parents[2]


def test_example_config_is_the_rendered_defaults():
    """config.toml is what `supervisor config init` writes: regenerate it when a key changes."""
    assert (REPO / "config.toml").read_text() == config.render(config.Config(), redact=False)


def test_example_config_loads_as_is():
    assert config.load(REPO / "config.toml", env={}) == config.Config()
