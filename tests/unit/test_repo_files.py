"""The files users copy from the repo stay true to the code."""

from pathlib import Path

from supervisor import config

REPO = Path(__file__).resolve().parents[2]


def test_example_config_is_the_rendered_defaults():
    """config.toml is what `supervisor config init` writes: regenerate it when a key changes."""
    assert (REPO / "config.toml").read_text() == config.render(config.Config(), redact=False)


def test_example_config_loads_as_is():
    assert config.load(REPO / "config.toml", env={}) == config.Config()


def test_the_readmes_test_install_brings_the_otel_extra():
    """CI runs the README's `pip install '.[test]' && python -m pytest` on a fresh clone: the
    tracing tests need the otel packages, so the test extra must pull them in; and the otel
    extra holds every package config loading checks for (supervisor.config.keys.OTEL_MODULES)."""
    import tomllib

    from supervisor.config.keys import OTEL_MODULES
    assert "pip install '.[test]' && python -m pytest" in (REPO / "README.md").read_text()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    otel = {req.split(">")[0].split("=")[0].strip() for req in extras["otel"]}
    assert set(OTEL_MODULES) <= otel
    assert "jetstream-supervisor[otel]" in extras["test"] or otel <= {r.split(">")[0].strip() for r in extras["test"]}
