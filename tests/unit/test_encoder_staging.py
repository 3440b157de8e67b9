"""The cache on a disk that cannot take it. Its embedding encoder's build
(cache/embedder.py:encoder_file) left a failed build's half-written file, one more each
restart (63 MB each on a full disk, a resource-exhaustion probe), and said "Protobuf
serialization failed", not that the disk was full; a milvus-lite file that would not open
there was said to be held by another process or damaged. The build is replaced here by one
that writes part of a file and fails as ONNX's serializer did, and the disk's free space is
given: a real full disk is not made in the unit lane."""

from __future__ import annotations

import os
import shutil
import time
from collections import namedtuple
from pathlib import Path

import pytest

from hopline.cache import embedder
from hopline.cache.embedder import EmbeddingModel, encoder_file
from hopline.cache.milvus_lite import NotADatabase, check_database_file, start_failure
from hopline.cache.store import EncoderBuildError

MODEL = EmbeddingModel("minilm", "ab" * 32, 384)
Usage = namedtuple("Usage", "total used free")


def _failing_build(weights_dir: Path, staging: Path) -> None:
    staging.write_bytes(b"\0" * 4096)
    raise RuntimeError("[ONNXRuntimeError] : 7 : INVALID_PROTOBUF : Protobuf serialization failed.")


def test_a_failed_build_leaves_nothing_and_a_full_disk_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedder, "build_encoder", _failing_build)
    folder = tmp_path / "embedders"
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(1 << 30, 1 << 30, 60 << 20))
    with pytest.raises(EncoderBuildError) as info:
        encoder_file(tmp_path / "weights", tmp_path, MODEL)
    assert "has 60 MiB free" in str(info.value)
    assert "HOPLINE_CACHE_DIR" in str(info.value)
    assert list(folder.iterdir()) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(1 << 40, 0, 1 << 40))
    with pytest.raises(RuntimeError, match="INVALID_PROTOBUF"):  # room enough: its own error
        encoder_file(tmp_path / "weights", tmp_path, MODEL)
    assert list(folder.iterdir()) == []


def test_a_killed_builds_file_goes_and_a_running_ones_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build killed mid-way (a kill -9, an OOM) leaves its file: gone at the next start
    once untouched for STALE_BUILD_S; one written recently may be another container's build
    in progress (containers sharing the folder are each pid 1) and stays."""
    folder = tmp_path / "embedders"
    folder.mkdir()
    stem = f"minilm-{MODEL.digest[:16]}-f{embedder.ENCODER_FORMAT}"
    killed = folder / f"{stem}.tmp1-0a1b2c3d"
    building = folder / f"{stem}.tmp1-4e5f6a7b"
    for staging in (killed, building):
        staging.write_bytes(b"\0" * 16)
    an_hour_ago = time.time() - 3600
    os.utime(killed, (an_hour_ago, an_hour_ago))

    def build(weights_dir: Path, staging: Path) -> None:
        assert staging.name.startswith(f"{stem}.tmp{os.getpid()}-")  # a name of its own
        staging.write_bytes(b"onnx")

    monkeypatch.setattr(embedder, "build_encoder", build)
    path, _ = encoder_file(tmp_path / "weights", tmp_path, MODEL)
    assert path.read_bytes() == b"onnx"
    assert sorted(p.name for p in folder.iterdir()) == sorted([path.name, building.name])


def test_a_lite_file_that_will_not_open_on_a_full_disk_says_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """milvus-lite refuses a fresh file on a full disk with "Open local milvus failed", which
    hopline read as another process holding it or damage, inviting a healthy file's deletion
    (a resource-exhaustion probe): on a disk with little room the disk is named first."""
    db = tmp_path / "cache.db"
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(1 << 30, 1 << 30, 0))
    said = start_failure(db, "Open local milvus failed", 0.5)
    assert "has 0 KiB free: probably full" in said
    assert "another process" not in said
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(1 << 40, 0, 1 << 40))
    assert "another process holds it" in start_failure(db, "Open local milvus failed", 0.5)


def test_an_empty_database_file_is_a_new_one_not_a_foreign_file(tmp_path: Path) -> None:
    """A start that failed on a full disk left an empty cache.db, and every later start
    refused it as "not a milvus-lite database (no SQLite header)": the user had to delete a
    file hopline made (a re-run of the resource-exhaustion probe). SQLite reads an empty file
    as a new database; so does the check now, and a file of something else is still refused."""
    empty = tmp_path / "cache.db"
    empty.write_bytes(b"")
    check_database_file(empty)
    other = tmp_path / "other.db"
    other.write_text("not a database")
    with pytest.raises(NotADatabase, match="no SQLite header"):
        check_database_file(other)


def test_a_folder_the_encoder_cannot_be_built_in_names_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only HOPLINE_CACHE_DIR without the encoder failed the start with a bare
    "[Errno 13] Permission denied" that named no setting (a cache probe). Root writes through
    read-only modes, so the folder is made unusable here by a file in its place, and a
    read-only one by the build's PermissionError with os.access saying no."""
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(EncoderBuildError, match="make HOPLINE_CACHE_DIR writable"):
        encoder_file(tmp_path / "weights", blocked, MODEL)

    def refused(weights_dir: Path, staging: Path) -> None:
        raise PermissionError(13, "Permission denied", str(staging))

    monkeypatch.setattr(embedder, "build_encoder", refused)
    monkeypatch.setattr(os, "access", lambda *_: False)
    with pytest.raises(EncoderBuildError, match=r"\(Permission denied\): make HOPLINE_CACHE_DIR"):
        encoder_file(tmp_path / "weights", tmp_path, MODEL)
