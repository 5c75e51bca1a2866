"""The on-disk array cache (fedtune.data.cache): a hit skips the build; a damaged entry is rebuilt
and replaced instead of failing or returning garbage."""

from __future__ import annotations

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
