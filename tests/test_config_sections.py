"""``[federation]`` split into ``[server]``, ``[robust]``, ``[secure_aggregation]`` and ``[placement]``
(issue 53, item 5): the old keys read for one release with a one-line note, a key given under both
names refused, every recipe on the new keys, and run folders written before the split resumed.
Each test has a control that shows it can fail."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import tomli_w
import tomllib
from typer.testing import CliRunner

from fedtune.cli import app
from fedtune.config import ConfigError, KeyMovedWarning, flat_keys, legacy, load_config
from fedtune.run import run_experiment
from tests.conftest import TINY, one_line_config_error, tiny

REPO = Path(__file__).resolve().parents[1]
#: the keys as [federation] named them before the split, written out here independently of
#: fedtune.config.legacy.MOVED (old name -> new dotted key)
BEFORE = {
    "server_optimizer": "server.optimizer",
    "server_lr": "server.lr",
    "server_betas": "server.betas",
    "server_eps": "server.eps",
    "server_weight_decay": "server.weight_decay",
    "server_bias_correction": "server.bias_correction",
    "aggregation": "robust.aggregation",
    "trim_fraction": "robust.trim_fraction",
    "clip_update_norm": "robust.clip_update_norm",
    "max_client_weight": "robust.max_client_weight",
    "max_update_ratio": "robust.max_update_ratio",
    "client_devices": "placement.client_devices",
    "gpus_per_client": "placement.gpus_per_client",
    "nodes": "placement.nodes",
    "secure_aggregation": "secure_aggregation.enabled",
    "secagg_clipping_range": "secure_aggregation.clipping_range",
    "secagg_quantization_range": "secure_aggregation.quantization_range",
    "secagg_modulus_range": "secure_aggregation.modulus_range",
    "secagg_num_shares": "secure_aggregation.num_shares",
    "secagg_threshold": "secure_aggregation.threshold",
}
#: every moved key at a value other than its default, in two valid configs (SecAgg+ refuses the robust ones)
ROBUST = {
    "engine": "flower",
    "server.optimizer": "adam",
    "server.lr": 0.01,
    "server.betas": [0.8, 0.99],
    "server.eps": 1e-6,
    "server.weight_decay": 0.01,
    "server.bias_correction": False,
    "robust.aggregation": "trimmed-mean",
    "robust.trim_fraction": 0.2,
    "robust.clip_update_norm": 3.0,
    "robust.max_update_ratio": 50.0,
    "placement.nodes": 2,
}
SECURE = {
    "engine": "flower-sim",
    "device": "cuda",
    "placement.gpus_per_client": 0.5,
    "secure_aggregation.enabled": True,
    "secure_aggregation.clipping_range": 2.0,
    "secure_aggregation.quantization_range": 2**20,
    "secure_aggregation.modulus_range": 2**31,
    "secure_aggregation.num_shares": 4,
    "secure_aggregation.threshold": 3,
}
EMBEDDED = {"placement.client_devices": ["cpu", "cpu"], "robust.max_client_weight": 0.5}
OLD_NAME = {new: f"federation.{old}" for old, new in BEFORE.items()}


def nest(flat: dict) -> dict:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}``."""
    tree: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def old_layout(tree: dict) -> dict:
    """A config tree (new keys) as written before the split (every moved key back under ``federation``)."""
    return nest({OLD_NAME.get(k, k): v for k, v in flat_keys(tree).items()})


def recipe(tmp_path: Path, flat: dict, name: str = "r.toml") -> Path:
    path = tmp_path / name
    path.write_text(tomli_w.dumps(nest(flat)))
    return path


def loaded(path: Path | None, *overrides: str) -> tuple[dict, list[str]]:
    """The resolved config's dump and the KeyMovedWarning lines loading it gave."""
    legacy._SEEN.clear()  # each test sees its notes (the registry keeps them once per process)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        config = load_config(path, list(overrides))
    return config.model_dump(mode="json"), [str(w.message) for w in caught if w.category is KeyMovedWarning]


@pytest.mark.parametrize("flat", [ROBUST, SECURE, EMBEDDED], ids=["robust", "secure", "embedded"])
def test_an_old_key_file_resolves_to_the_new_key_files_config_with_one_note_per_key(tmp_path, flat):
    """Every moved key, given under its old name, lands on its new key: the resolved config equals
    the new-key file's, and each old key is noted once, naming old and new. Control: the new-key
    file gives no note, and a config differing in one key differs (the comparison can fail)."""
    new, new_notes = loaded(recipe(tmp_path, flat, "new.toml"))
    old, old_notes = loaded(recipe(tmp_path, {OLD_NAME.get(k, k): v for k, v in flat.items()}, "old.toml"))
    assert old == new and new_notes == []
    moved = [k for k in flat if k in OLD_NAME]
    assert len(old_notes) == len(moved)
    for key, note in zip(moved, old_notes):
        assert note.startswith(f"{OLD_NAME[key]} is now {key} (recipe ") and "\n" not in note
    again, notes = loaded(recipe(tmp_path, {**flat, "server.lr": 0.02}, "other.toml"))
    assert again != new and notes == []


def test_each_note_shows_once_per_process():
    """Two loads with the same old key: one note. Control: a second old key adds its own."""
    legacy._SEEN.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            load_config(None, ["federation.server_lr=0.5"])
        load_config(None, ["federation.clip_update_norm=2"])
    notes = [str(w.message) for w in caught if w.category is KeyMovedWarning]
    assert notes == [
        "federation.server_lr is now server.lr (--set; the old key is read until the next release)",
        "federation.clip_update_norm is now robust.clip_update_norm (--set; the old key is read until the next "
        "release)",
    ]


def test_an_old_key_set_overrides_the_new_key_of_the_recipe(tmp_path):
    """``--set federation.server_lr`` on a recipe with ``[server] lr`` overrides it (it is the same
    key). Control: the recipe alone keeps its value."""
    path = recipe(tmp_path, {"server.lr": 0.1})
    assert loaded(path)[0]["server"]["lr"] == 0.1
    dump, notes = loaded(path, "federation.server_lr=0.2")
    assert dump["server"]["lr"] == 0.2 and notes == [
        "federation.server_lr is now server.lr (--set; the old key is read until the next release)"
    ]


@pytest.mark.parametrize(
    ("text", "both"),
    [
        ("[federation]\nserver_lr = 0.1\n[server]\nlr = 0.2\n", ("federation.server_lr", "server.lr")),
        (
            "secure_aggregation = false\n[federation]\nsecure_aggregation = true\n",
            ("federation.secure_aggregation", "secure_aggregation.enabled"),
        ),
        (
            "[federation]\nsecagg_threshold = 3\n[secure_aggregation]\nthreshold = 3\n",
            ("federation.secagg_threshold", "secure_aggregation.threshold"),
        ),
    ],
)
def test_a_file_giving_one_key_under_both_names_is_refused_in_one_line_naming_both(tmp_path, text, both):
    """``fedtune run`` on such a recipe: exit 2, one line naming both keys, no run folder. Control:
    the file without its new-key table is read (no such refusal)."""
    path = tmp_path / "both.toml"
    path.write_text(text)
    out = tmp_path / "runs"
    sets = sum((["--set", t] for t in [*TINY, "rounds=1", f"output_dir={out}"]), [])
    result = CliRunner().invoke(app, ["run", str(path), *sets])  # tiny: a wrong version ends in seconds
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert all(key in lines[0] for key in both) and "both given" in lines[0] and not out.exists()
    path.write_text("[federation]" + text.split("[federation]")[1].split("[")[0])
    try:
        load_config(path)
    except ConfigError as exc:  # secagg_threshold alone: "applies to secure_aggregation.enabled = true"
        assert "both given" not in str(exc)


def recipes() -> list[Path]:
    return sorted((REPO / "configs").rglob("*.toml"))


def test_every_recipe_and_benchmark_config_uses_the_new_keys():
    """No TOML under configs/ (recipes, benchmark suites, their overlays) holds an old key, as a
    table key or in an override string; every top-level recipe loads with no note. Control: the
    FSLoRA recipe written back in the old layout is caught by both checks."""
    old = {f"federation.{k}" for k in BEFORE}

    def old_keys(tree: dict) -> list[str]:
        flat = flat_keys(tree)
        found = [k for k in flat if any(k == o or k.endswith(f".{o}") for o in old)]
        strings = [v for v in flat.values() if isinstance(v, str)]
        strings += [s for v in flat.values() if isinstance(v, list) for s in v if isinstance(s, str)]
        return found + [s for s in strings if any(f"{o}=" in s for o in old)]

    assert len(recipes()) > 30
    for path in recipes():
        assert old_keys(tomllib.loads(path.read_text())) == [], path
    for path in sorted((REPO / "configs").glob("*.toml")):
        assert loaded(path)[1] == [], path
    fslora = tomllib.loads((REPO / "configs" / "fslora.toml").read_text())
    assert old_keys(old_layout(fslora)) == ["federation.server_optimizer", "federation.server_lr"] + [
        "federation.server_weight_decay"
    ]


def written_before_the_split(run_dir: Path) -> None:
    """Rewrite a run folder's config.toml and run_config.json as fedtune wrote them before the split."""
    config = json.loads((run_dir / "run_config.json").read_text())
    (run_dir / "run_config.json").write_text(json.dumps(old_layout(config)))
    toml = tomllib.loads((run_dir / "config.toml").read_text())
    (run_dir / "config.toml").write_text(tomli_w.dumps(old_layout(toml)))


def test_a_run_folder_written_before_the_split_resumes_from_the_cli_without_notes(tmp_path, monkeypatch):
    """Two rounds, the folder's config files put in the old layout, then ``fedtune run --resume``
    to three: it resumes (no note: fedtune wrote those keys) and records round 3. Control: without
    the old keys moved in the resume check the same resume is refused as a changed config."""
    sets = sum((["--set", t] for t in TINY), []) + ["--set", f"output_dir={tmp_path}", "--set", "name=old"]
    first = CliRunner().invoke(app, ["run", *sets, "--set", "server.lr=0.5"])
    assert first.exit_code == 0, first.output
    run_dir = tmp_path / "old"
    written_before_the_split(run_dir)
    assert "server_lr = 0.5" in (run_dir / "config.toml").read_text()

    import fedtune.resume

    monkeypatch.setattr(fedtune.resume, "split_federation", lambda tree, **_: tree)
    refused = CliRunner().invoke(app, ["run", "--resume", str(run_dir), "--set", "rounds=3"])
    assert refused.exit_code == 2 and "the config differs" in refused.output, refused.output
    monkeypatch.undo()
    legacy._SEEN.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        resumed = CliRunner().invoke(app, ["run", "--resume", str(run_dir), "--set", "rounds=3"])
    assert resumed.exit_code == 0, resumed.output
    assert [w for w in caught if w.category is KeyMovedWarning] == []
    rounds = [json.loads(line)["round"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]


CENTRAL = ['privacy.mode="central"', "privacy.clip=0.05", "privacy.noise_multiplier=0.8"]


def test_a_dp_run_folder_written_before_the_split_resumes_under_its_fingerprint(tmp_path, monkeypatch):
    """A DP checkpoint fingerprints the config's keys (fedtune.fingerprint). One round written as
    before the split (its fingerprint over the old key names, computed here from :data:`BEFORE`,
    and the old config files), then a resume to two rounds: it passes the fingerprint check.
    Control: a resume that fingerprints the new names is refused ("the config" changed)."""
    import fedtune.run
    from fedtune.resume import MAY_CHANGE_ON_RESUME

    def old_names(config) -> dict:
        flat = {OLD_NAME.get(k, k): v for k, v in flat_keys(config.model_dump(mode="json")).items()}
        # server.momentum came after the split: a checkpoint from before it never fingerprinted it
        return {k: v for k, v in flat.items() if k not in MAY_CHANGE_ON_RESUME and k != "server.momentum"}

    config = tiny(tmp_path, "fedit", "text-classification", *CENTRAL, "rounds=1", "name=dp")
    assert set(old_names(config)) == set(fedtune.run.resumable_keys(config))  # the same names as before
    monkeypatch.setattr(fedtune.run, "resumable_keys", old_names)
    run_dir = Path(run_experiment(config)["run_dir"])
    monkeypatch.undo()
    written_before_the_split(run_dir)
    resumed = tiny(tmp_path, "fedit", "text-classification", *CENTRAL, "rounds=2", "name=dp")

    monkeypatch.setattr(fedtune.run, "resumable_keys", lambda c: flat_keys(c.model_dump(mode="json")))
    assert "the config" in one_line_config_error(lambda: run_experiment(resumed, resume=True))
    monkeypatch.undo()
    assert run_experiment(resumed, resume=True)["rounds"] == 2


def test_a_dp_run_folder_written_before_a_key_was_added_resumes_and_refuses_the_key_changed(tmp_path):
    """``server.momentum`` is newer than run folders written before it: their run_config.json lacks
    it (removed here from a one-round DP run) and they ran without momentum. Such a folder resumes;
    a resume that sets the key to anything else is refused naming it. Wrong version caught: the
    resume check reading the missing key as a change ("differs ... in server.momentum")."""
    config = tiny(tmp_path, "fedit", "text-classification", *CENTRAL, "rounds=1", "name=dp")
    run_dir = Path(run_experiment(config)["run_dir"])
    written = json.loads((run_dir / "run_config.json").read_text())
    del written["server"]["momentum"]
    (run_dir / "run_config.json").write_text(json.dumps(written))
    toml = tomllib.loads((run_dir / "config.toml").read_text())
    toml.get("server", {}).pop("momentum", None)
    (run_dir / "config.toml").write_text(tomli_w.dumps(toml))
    moved = tiny(tmp_path, "fedit", "text-classification", *CENTRAL, "rounds=2", "name=dp", "server.momentum=0.5")
    line = one_line_config_error(lambda: run_experiment(moved, resume=True))
    assert "differs from the one the run started with in server.momentum" in line, line
    resumed = tiny(tmp_path, "fedit", "text-classification", *CENTRAL, "rounds=2", "name=dp")
    assert run_experiment(resumed, resume=True)["rounds"] == 2


def test_a_plugin_method_declaring_an_old_option_name_honours_its_new_one():
    """``register(..., supports=("federation.aggregation",))`` (a plugin written before the split):
    the method honours ``robust.aggregation``, with one note. Control: a name that never was an
    option is still refused."""
    from fedtune import registry
    from fedtune.methods.fedavg import FedAvgClient, FedAvgStrategy

    legacy._SEEN.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            spec = registry.register("old-plugin", FedAvgStrategy, FedAvgClient, supports=("federation.aggregation",))
        assert spec.honours == {"robust.aggregation"}
        assert [str(w.message) for w in caught if w.category is KeyMovedWarning] == [
            "federation.aggregation is now robust.aggregation (register('old-plugin', supports=...); the old key "
            "is read until the next release)"
        ]
    finally:
        registry._METHODS.pop("old-plugin", None)
    with pytest.raises(ValueError, match="unknown cross-method options"):
        registry.register("bad-plugin", FedAvgStrategy, FedAvgClient, supports=("federation.no_such_option",))
    assert "bad-plugin" not in registry._METHODS
