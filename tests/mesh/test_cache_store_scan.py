"""Reads of a whole group go past Milvus's query result window: a plain query returns at most
16,384 rows whatever its filter matches, so the eviction's scan for a group's oldest entries
(used where the exact index cannot say: over a shared Milvus server, or an index smaller than
the group) picked them from an arbitrary part of a larger group. A real milvus-lite file."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest

from hopline.cache.milvus_store import MilvusStore
from hopline.cache.store import Entry, Vector

DIM = 4
WINDOW = 16_384  # Milvus's and milvus-lite's most rows for one query
ROWS = WINDOW + 600
OLDEST = 100
SCOPE = ("t", "m", "1", "{}")


def entry(i: int, now: float) -> Entry:
    # Written in order, each older than the last: the oldest are the rows written last, which
    # a query capped at the first WINDOW rows it meets does not reach.
    return Entry(f"{i:064x}", SCOPE, f"text {i}", b"x", now - i, now + 3600)


def test_the_oldest_of_a_group_larger_than_one_query_are_found(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pymilvus")
    store = MilvusStore(str(tmp_path / "cache.db"), "scan_test", DIM)
    try:
        vector: Vector = np.full(DIM, 0.5, dtype=np.float32)
        now = time.time()
        for start in range(0, ROWS, 2000):
            store.upsert([(entry(i, now), vector) for i in range(start, min(start + 2000, ROWS))])
        assert store.count("t", "m") == ROWS
        expected = [f"{i:064x}" for i in range(ROWS - 1, ROWS - 1 - OLDEST, -1)]
        assert store.oldest("t", "m", OLDEST) == expected
        assert len(store.live(now)) == ROWS
        # milvus-lite gives its iterators no session timestamp; pymilvus's warning about it,
        # once per scan, is dropped (cache/milvus_lite.py says why).
        assert not [r for r in caplog.records if "mvccTs" in r.getMessage()]
    finally:
        store.close()
