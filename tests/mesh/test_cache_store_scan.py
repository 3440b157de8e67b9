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

from hopline.cache.keys import digest, scope_digest
from hopline.cache.milvus_rows import SCALARS, from_row
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


def test_a_write_of_new_and_replaced_keys_lands_every_field_of_every_row(tmp_path: Path) -> None:
    """The writer's batches go to Milvus column by column (MilvusStore._insert_columns), and
    keys already there as row upserts: every field read back is the entry's, the digests the
    filters compare included, whichever way a row went."""
    store = MilvusStore(str(tmp_path / "cache.db"), "fields_test", DIM)
    try:
        now = time.time()
        scopes = [SCOPE, ("other", "m", "2", '{"top_k":2}'), ("t", "m2", "1", "{}")]

        def row(i: int, answer: bytes) -> tuple[Entry, Vector]:
            entry = Entry(f"{i:064x}", scopes[i % 3], f"text é {i}", answer, now - i, now + i)
            return entry, np.array([i, 1, 0.5, -i], dtype=np.float32)

        store.upsert([row(i, b"first") for i in range(6)])
        # Three keys written again with another answer beside three new ones.
        batch = [row(i, b"second \x00\xff") for i in range(3, 9)]
        store.upsert(batch)
        expected = {e.key: (e, v) for e, v in [*[row(i, b"first") for i in range(3)], *batch]}
        fields = ["id", "vector", *SCALARS]
        got = store._client.query(
            store.collection, filter='id != ""', output_fields=fields, consistency_level="Strong"
        )
        assert len(got) == len(expected) == 9  # a replaced key leaves one row
        for read in got:
            entry, vector = expected[read["id"]]
            assert from_row(read) == entry
            tenant, model, version, _ = entry.scope
            digests = [digest("tenant", tenant), digest("model", model)]
            digests += [digest("version", model, version), scope_digest(entry.scope)]
            assert [read[k] for k in ("tenant_key", "model_key", "version_key", "scope_key")] == (
                digests
            )
            np.testing.assert_allclose(read["vector"], vector, rtol=1e-6)
        assert store.count("other", "m") == 3
    finally:
        store.close()


def test_the_rebuild_reads_every_live_row_once_from_every_id_range(tmp_path: Path) -> None:
    """The exact index's rebuild reads 16 id ranges side by side (`MilvusStore.live`): every
    live row comes back once, the ranges' first and last ids included and a range read over
    several pages, and no expired row does."""
    store = MilvusStore(str(tmp_path / "cache.db"), "ranges_test", DIM)
    try:
        now = time.time()
        vector: Vector = np.full(DIM, 0.5, dtype=np.float32)
        edges = [first + fill * 63 for first in "0123456789abcdef" for fill in "0f"]
        spread = [digest("row", str(i)) for i in range(2000)]
        expired = [digest("expired", str(i)) for i in range(300)]
        rows = [
            (Entry(key, SCOPE, "text", b"x", now, now + ttl), vector)
            for keys, ttl in ((edges, 3600), (spread, 3600), (expired, -1))
            for key in keys
        ]
        for start in range(0, len(rows), 1000):
            store.upsert(rows[start : start + 1000])
        read = [entry.key for entry in store.live(now, page=50)]
        assert len(read) == len(edges) + len(spread)
        assert sorted(read) == sorted([*edges, *spread])
    finally:
        store.close()
