"""The on-disk array cache (fedtune.data.cache): a hit skips the build; a damaged entry is rebuilt
and replaced instead of failing or returning garbage."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedtune.data import cache


def test_a_damaged_entry_is_rebuilt_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    calls = []

    def build():
        calls.append(1)
        return {"x": np.arange(5, dtype=np.int64)}, {"n": 5}

    parts = {"what": "test"}
    first, meta = cache.cached_arrays("t", parts, build)
    again, _ = cache.cached_arrays("t", parts, build)
    assert len(calls) == 1 and meta == {"n": 5} and np.array_equal(again["x"], first["x"])

    (tmp_path / "t" / cache.cache_key(parts) / "meta.json").write_text("{not json")
    rebuilt, meta = cache.cached_arrays("t", parts, build)
    assert len(calls) == 2 and meta == {"n": 5} and np.array_equal(rebuilt["x"], np.arange(5))
    cache.cached_arrays("t", parts, build)  # the replaced entry is a hit again
    assert len(calls) == 2


def test_a_converted_tokenizer_is_kept_per_source_and_read_back_alike(tmp_path, monkeypatch):
    """:func:`cache.cached_tokenizer`: the first call converts (``load``), later ones read the
    saved tokenizer, which encodes, decodes and templates as the converted one did; another
    source (a changed file) converts again; a damaged entry is rebuilt; caching off converts."""
    from fedtune.models import prefix_lm as plm

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    calls = []

    def load():
        calls.append(1)
        return plm.byte_tokenizer()

    parts = {"gguf": "/models/m.gguf", "size": 10, "mtime_ns": 1, "transformers": "5"}
    first = cache.cached_tokenizer(parts, load)
    again = cache.cached_tokenizer(parts, load)
    assert len(calls) == 1 and again is not first
    for text in ("Hello, world", "café crème 四\n<|im_start|>user\nhi<|im_end|>", "  \n\t"):
        ids = again(text, add_special_tokens=False)["input_ids"]
        assert ids == first(text, add_special_tokens=False)["input_ids"] and again.decode(ids) == text
    turns = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(turns, tokenize=False) == first.apply_chat_template(turns, tokenize=False)
    assert (again.bos_token_id, again.eos_token_id, len(again)) == (first.bos_token_id, first.eos_token_id, len(first))
    cache.cached_tokenizer({**parts, "mtime_ns": 2}, load)  # the file changed: convert again
    assert len(calls) == 2
    entry = tmp_path / "tokenizers" / cache.cache_key(parts)
    (entry / "tokenizer.json").write_text("{not json")
    cache.cached_tokenizer(parts, load)
    cache.cached_tokenizer(parts, load)  # the replaced entry is a hit again
    assert len(calls) == 3
    monkeypatch.setenv(cache.CACHE_ENV, "off")
    cache.cached_tokenizer(parts, load)
    assert len(calls) == 4


def test_packaged_gguf_tokenizers_are_keyed_by_their_file(monkeypatch):
    """SmolLM2's (and Gemma's) tokenizer goes through the cache, keyed by the GGUF file itself."""
    from fedtune.models import prefix_lm as plm

    seen = []
    monkeypatch.setattr(cache, "cached_tokenizer", lambda parts, load: seen.append(parts) or "tok")
    source = plm.gguf_source(plm.SMOLLM2)
    assert plm._gguf_tokenizer(source) == "tok"
    path = Path(source["pretrained_model_name_or_path"]) / plm.SMOLLM2_FILE
    from importlib.metadata import version

    stat = path.stat()
    assert seen[0] == {
        "gguf": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "transformers": version("transformers"),
    }
