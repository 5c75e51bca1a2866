"""The config reference (docs/config.md) is generated from the config classes: every key of a
recipe has an entry with its type, default and a description, and a key added without one fails."""

from __future__ import annotations

from fedtune.config import LoggingConfig, RunConfig, flat_keys
from fedtune.config_reference import entries, markdown, option_entries, undocumented
from fedtune.methods import list_methods
from fedtune.tasks import list_tasks


def test_every_config_key_has_an_entry_with_a_description():
    assert undocumented() == []
    text = markdown()
    keys = flat_keys(RunConfig().model_dump(mode="json"))
    for key in [*keys, *(k.rpartition(".")[0] for k in keys if "." in k)]:
        if not key.startswith("options"):  # the method's own: listed per method below
            assert f"| `{key}` |" in text, key
    for spec in list_methods():
        for name in spec.options.model_fields:
            assert f"| `options.{name}` |" in text.split(f"## options ({spec.name})")[1].split("\n## ")[0]
    for task in list_tasks():
        for name in task.Options.model_fields:
            assert f"| `task.{name}` |" in text.split(f"## task ({task.kind})")[1].split("\n## ")[0]
    assert {e.key for e in entries()} >= {"federation.profiles[].memory_gib", "federation.device_classes[].share"}
    assert option_entries()


def test_a_key_added_without_a_description_is_named(monkeypatch):
    """Control: a new ``[logging]`` key with no description is what undocumented() names."""

    class WithNewKey(LoggingConfig):
        new_key: int = 1

    field = RunConfig.model_fields["logging"]
    monkeypatch.setitem(RunConfig.model_fields, "logging", type(field).merge_field_infos(field, annotation=WithNewKey))
    assert undocumented() == ["logging.new_key"]
    assert "| `logging.new_key` | int | `1` |  |" in markdown()


def test_the_aggregation_entry_names_every_combiner_of_fedtune_and_the_two_ways_to_bring_ones_own():
    from fedtune.methods.base.robust import list_combiners

    (row,) = [line for line in markdown().splitlines() if line.startswith("| `robust.aggregation` |")]
    own = [spec.name for spec in list_combiners() if spec.module.startswith("fedtune.")]
    assert own and all(f'("{name}")' in row for name in own), row
    assert "fedtune.combiners" in row and "my_pkg.module:NAME" in row and "refused under DP, SecAgg+" in row
