"""Config: recipes, overrides, one-line errors naming the key."""

import pytest

from fedtune.config import ConfigError, load_config, parse_value


def test_string_section_means_name_and_overrides_compose(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('method = "fedit"\ndata = "sst2"\n[train]\nlr = 0.01\n')
    cfg = load_config(recipe, ["data.alpha=0.1", "train.local_steps=3", "federation.clients_per_round=5"])
    assert (cfg.data.name, cfg.data.alpha, cfg.train.lr, cfg.train.local_steps) == ("sst2", 0.1, 0.01, 3)
    assert cfg.federation.sample_size() == 5


def test_parse_value_types():
    assert parse_value("3") == 3 and parse_value("0.5") == 0.5 and parse_value("true") is True
    assert parse_value('["query", "value"]') == ["query", "value"]
    assert parse_value("sst2") == "sst2"


@pytest.mark.parametrize(
    "override, field",
    [
        ("rounds=0", "rounds"),
        ("data.alpha=-1", "data.alpha"),
        ("train.optimizer=lion", "train.optimizer"),
        ("federation.bogus=1", "federation.bogus"),
        ("unknown_key=1", "unknown_key"),
        ("federation.clients_per_round=99", "federation.clients_per_round"),
    ],
)
def test_invalid_values_name_the_field_in_one_line(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert message.startswith(field) and "\n" not in message


def test_missing_recipe_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_method_options_are_validated(tiny_config):
    from fedtune.runtime import RunContext, resolve_run

    with pytest.raises(ConfigError, match=r"^options\.weighting"):
        RunContext(resolve_run(tiny_config("options.weighting=median")))
    with pytest.raises(ConfigError, match=r"^method: unknown method 'nope'"):
        RunContext(resolve_run(tiny_config("method=nope")))


def test_bad_profile_names_the_client(tiny_config):
    from fedtune.runtime import RunContext, resolve_run

    with pytest.raises(ConfigError, match=r"federation\.profiles\[1\]\.sketch_ratio"):
        RunContext(resolve_run(tiny_config("federation.profiles=[{sketch_ratio=0.5}, {sketch_ratio=2.0}, {}, {}]")))
