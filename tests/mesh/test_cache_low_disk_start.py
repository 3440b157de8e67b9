"""A milvus-lite file opened on a disk with less free than the store writes with says so at
once (cache/milvus_store.py): before, the cache went SERVING silent and said it only at the
first failed write, stores already queued."""

from __future__ import annotations

import logging
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from hopline.cache.milvus_store import MilvusStore

_Usage = namedtuple("_Usage", "total used free")


def test_a_store_opened_on_a_disk_short_of_space_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = shutil.disk_usage
    db = tmp_path / "cache.db"

    def small_disk(path: str | Path) -> object:
        if Path(path) == db.resolve().parent:
            return _Usage(20 << 20, 0, 20 << 20)  # a 20 MiB volume, empty
        return real(path)

    monkeypatch.setattr(shutil, "disk_usage", small_disk)  # milvus_lite.disk_note reads it
    with caplog.at_level(logging.WARNING, logger="hopline.cache.milvus_store"):
        store = MilvusStore(str(db), "low_disk_start", 8, timeout_s=5.0)
        store.close()
    said = [r for r in caplog.records if "short of space" in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    assert "20480 KiB free" in said[0].__dict__["note"]
