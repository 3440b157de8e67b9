"""Closing a store on a milvus-lite file stops milvus-lite's server at once (SIGTERM), not
after milvus-lite's own 2 s wait and SIGKILL, and the next open reads back every write the
server acknowledged before the stop (cache/milvus_lite.py:stop_server)."""

from __future__ import annotations

import hashlib
import signal
import time
from pathlib import Path

import numpy as np

from hopline.cache import milvus_lite
from hopline.cache.milvus_store import MilvusStore
from hopline.cache.store import Entry

ROWS = 300
DELETED = 20


def key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()  # a cache key is a SHA-256 digest


def row(i: int) -> tuple[Entry, np.ndarray[tuple[int], np.dtype[np.float32]]]:
    now = time.time()
    vector = np.zeros(4, np.float32)
    vector[i % 4] = 1.0
    entry = Entry(key(i), ("t", "m", "1", "{}"), f"text {i}", b"reply", now, now + 3600)
    return entry, vector


def test_a_closed_store_stops_its_server_at_once_and_loses_nothing(tmp_path: Path) -> None:
    db = tmp_path / "cache.db"
    store = MilvusStore(str(db), "c", 4, timeout_s=5.0)
    server = milvus_lite._server_process(db)
    assert server is not None
    try:
        store.upsert([row(i) for i in range(ROWS)])
        assert store.delete([key(i) for i in range(DELETED)]) == DELETED
    finally:
        store.close()
    assert server.returncode == -signal.SIGTERM  # milvus-lite's own stop: SIGKILL, after 2 s
    assert not milvus_lite.starting(db)

    again = MilvusStore(str(db), "c", 4, timeout_s=5.0)
    try:
        assert again.count() == ROWS - DELETED
        assert again.get(key(DELETED), time.time()) is not None
        assert again.get(key(0), time.time()) is None
    finally:
        again.close()
